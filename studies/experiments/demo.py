"""The main job on embedded defaults, end to end on one machine.

Prepare the model, start the serving process with LEAP, send real prompts to its OpenAI API as traffic (so
feedback segments appear), then run the pipeline's own flows: ingest into DuckDB, fit and register a
readout in MLflow, gate it by replaying held-out traffic through the real engine, and push and promote it
to the running server. Every step is the production code path; only the sizes are small. The output
budget is the snapshot's M (1,024 tokens), where about one chat output in ten reaches it, so the readouts
fitted and plotted predict real lengths, not the cap.

The first champion (`first_champion`):
- "none" (the default): a first deployment. Serving starts on FCFS, the order stock vLLM runs, capturing
  the candidate recipes' hidden states; the fit flow fits the first readout on the traffic's feedback and
  the gate decides whether it beats FCFS. The challenger is truly better (length-aware order against
  arrival order), and a gate of the demo's size sees it: over 10 clean runs the first readout's mean PTL
  was x0.78 to x0.80 of FCFS's on the 48 held-out requests, every interval's upper end below x0.96, and
  every run promoted it (docs/serving.md). A weak first champion (fitted on 16 snapshot rows, or on
  another domain's) leaves its challenger a gain of a few percent, which 48 requests do not resolve.
- "snapshot": a champion fitted on the committed corpus snapshot's chat rows (so the server predicts, and
  RLS corrects, from its first request); the challenger refines it with the traffic's 192 training rows,
  a readout of about equal quality, which the gate rightly calls no different and keeps out.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from leap_io.admin_client import AdminClient

DEMO_DECODING = {"temperature": 0.0, "frequency_penalty": 0.5}


async def _send_traffic(base_url: str, model: str, prompts: list[dict], max_tokens: int,
                        concurrency: int, on_done: Callable[[int], None] | None) -> dict:
    """Send every prompt once to the chat API; the id travels in vllm_xargs so feedback rows carry it."""
    semaphore = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    done = 0

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0)) as client:
        async def one(prompt: dict) -> None:
            nonlocal done
            body = {"model": model, "messages": [{"role": "user", "content": prompt["prompt"]}],
                    "max_tokens": max_tokens, **DEMO_DECODING,
                    "vllm_xargs": {"leap_request_id": prompt["id"], "leap_domain": prompt.get("domain") or ""}}
            async with semaphore:
                response = await client.post("/chat/completions", json=body)
            if response.status_code != 200:
                failures.append(f"{prompt['id']}: {response.status_code} {response.text[:200]}")
            done += 1
            if on_done is not None:
                on_done(done)

        await asyncio.gather(*(one(p) for p in prompts))
    return {"sent": len(prompts), "failed": len(failures), "failures": failures[:5]}


DEMO_RECIPES = ("last@22", "last@17", "last@17+last@22")
"""The candidate recipes of the demo's replica and fit flow: cheap last-token recipes of two layers (the
recipe study's; `leap eval recipes` compares many more). The replica captures all of them."""

FIRST_CHAMPIONS = ("none", "snapshot")
"""What serves before the demo's first fit: nothing (FCFS, a first deployment) or a snapshot readout."""


def capture_candidates(model: Any, recipes: tuple[str, ...] = DEMO_RECIPES) -> tuple[str, ...] | None:
    """`recipes` when every layer they read exists in `model` (a replica then captures their union and the
    fit flow chooses among them), else None: the default capture, no choice."""
    from leap_core.recipes import Recipe

    layers = {block.layer for r in recipes for block in Recipe.parse(r).blocks if block.layer is not None}
    return recipes if all(0 <= layer < model.num_layers for layer in layers) else None


def _recipe_rows(model: Any, rows: Any, recipes: tuple[str, ...]) -> tuple[Any, Any] | None:
    """(rows with the wide recipe's features instead of layer L's, that wide recipe) for the chat rows the
    committed recipe corpus holds, or None when it holds too few or does not cover every candidate."""
    from leap_core.recipes import Recipe
    from study_harness.corpus import corpus_dir
    from study_harness.recipe_corpus import WIDE_RECIPE, joined, recipe_corpus_key, recipe_rows

    if not all(Recipe.parse(r).covered_by(WIDE_RECIPE, model.hidden_size) for r in recipes):
        return None
    wide = joined(recipe_rows(corpus_dir(recipe_corpus_key(model.fingerprint, WIDE_RECIPE))), rows)
    return (wide, WIDE_RECIPE) if len(wide) >= 100 else None


def bootstrap_champion(tracking_uri: str, model: Any, max_tokens: int, exclude: list[dict],
                       test_fraction: float = 0.2, recipes: tuple[str, ...] = DEMO_RECIPES) -> dict[str, Any]:
    """Register a readout fitted on the snapshot's chat rows (minus the `exclude` prompts, matched by id and
    by text, since the embedded package numbers ShareGPT differently) as the first champion.

    The recipe (and so the layer) is chosen among `recipes` by validation on the training rows only, as
    the fit flow chooses (`leap_core.recipe_choice`), from the committed recipe corpus; the readout is
    registered under the layer a replica capturing every candidate reports (the first layer of their
    union). Without a recipe corpus for this model, the last token of the default layer, as before.

    Idempotent: a registry that already has a champion for this model and layer keeps it. Without a
    snapshot for this model (another model, another M) nothing is registered and serving starts
    without a readout, as before."""
    import numpy as np

    from harness.replay import DEFAULT_DECODING
    from leap_core.alpha import kfold
    from leap_core.layers import default_layer
    from leap_core.metrics import spearman
    from leap_core.recipe_choice import choose_recipe, validate_recipes
    from leap_core.recipes import RECIPE_VERSION, Recipe, union
    from leap_core.rls import fit_readout_with_anchor
    from registry.client import CHAMPION, ReadoutRegistry
    from study_harness.corpus import corpus_dir, corpus_key, load_corpus
    from study_harness.snapshot import provenance, stored_texts

    corpus_layer = default_layer(model.num_layers)
    key = corpus_key(model.fingerprint, corpus_layer, max_tokens, DEFAULT_DECODING)
    rows = load_corpus(corpus_dir(key), corpus_layer, max_tokens)
    texts = stored_texts()
    excluded_ids, excluded_texts = {p["id"] for p in exclude}, {p["prompt"] for p in exclude}
    usable = (rows.domains == "chat") & np.array([i not in excluded_ids and texts.get(i) not in excluded_texts
                                                  for i in rows.ids.astype(str)], dtype=bool)
    chat = rows.subset(np.flatnonzero(usable))
    wide = _recipe_rows(model, chat, recipes) if recipes else None
    capture = union(recipes) if wide is not None else Recipe.last(corpus_layer)
    if wide is not None:
        chat, wide_recipe = wide
    layer = next(b.layer for b in capture.blocks if b.layer is not None)
    registry = ReadoutRegistry(tracking_uri)
    name = registry.model_name(model.model_id, layer)
    current = registry.get_alias(name, CHAMPION)
    if current is not None:
        return {"status": "kept", "name": name, "version": current, "capture_recipe": str(capture),
                "recipe_candidates": list(recipes) if wide is not None else None}
    if len(chat) < 100:
        return {"status": "no-snapshot", "name": name, "rows": len(chat), "recipe_candidates": None}
    order = np.random.default_rng(0).permutation(len(chat))
    n_test = int(round(test_fraction * len(chat)))
    train, test = chat.subset(np.sort(order[n_test:])), chat.subset(np.sort(order[:n_test]))
    validation = None
    chosen = capture
    columns = np.arange(train.features.shape[1])
    if wide is not None:
        matrices = {r: train.features[:, Recipe.parse(r).columns(wide_recipe, model.hidden_size)] for r in recipes}
        validation = validate_recipes(matrices, train.output_tokens, max_tokens=max_tokens, cv=kfold())
        picked = choose_recipe(validation)
        chosen = Recipe.parse(picked["recipe"])
        columns = chosen.columns(wide_recipe, model.hidden_size)
    source = provenance()
    metadata = dict(model_id=model.model_id, model_fingerprint=model.fingerprint, layer=layer, recipe=str(chosen),
                    recipe_version=RECIPE_VERSION, version=f"snapshot-{source['corpus_hash'][:8]}",
                    n_train=len(train))
    alpha = next((row["alpha"] for row in validation or [] if row["recipe"] == str(chosen)), 1000.0)
    readout, rls = fit_readout_with_anchor(train.features[:, columns], train.output_tokens, alpha=alpha,
                                           max_tokens=max_tokens, metadata=metadata)
    predicted = readout.predict(test.features[:, columns])
    logged = registry.log_readout(
        readout, rls=rls,
        params={"source": "corpus snapshot", "corpus_hash": source["corpus_hash"], "corpus_key": key,
                "n_train": len(train), "n_test": len(test), "max_tokens": max_tokens, "recipe": str(chosen),
                "recipe_candidates": ",".join(recipes) if wide is not None else "", "capture_recipe": str(capture)},
        metrics={"test_spearman": spearman(test.output_tokens, predicted),
                 "test_mae": float(np.mean(np.abs(predicted - test.output_tokens))),
                 "train_capped_fraction": train.capped_fraction()},
        eval_arrays={"true": test.output_tokens, "pred": predicted}, run_name="bootstrap-from-snapshot",
        validation=validation)
    registry.promote(name, logged.version)
    return {"status": "registered", "name": name, "version": str(logged.version), "rows": len(train),
            "corpus_hash": source["corpus_hash"], "recipe": str(chosen), "capture_recipe": str(capture),
            "recipe_candidates": list(recipes) if wide is not None else None, "validation": validation}


def demo_prompts(n: int, max_prompt_chars: int = 600) -> list[dict]:
    """The first `n` ShareGPT prompts of at most `max_prompt_chars` characters: short prompts keep prefill,
    which dominates on two CPU cores, small; the selection is by text only."""
    from harness.datasets import available_prompts

    return [p for p in available_prompts(None, sets=["sharegpt"])
            if p["prompt"].strip() and len(p["prompt"]) <= max_prompt_chars][:n]


def demo_environment(prompts: list[dict], max_tokens: int) -> None:
    """The pipeline settings of a demo, as defaults under any LEAP_* already set: the gate replays the
    demo's prompts, the budget is the snapshot's, and the challenger refines the snapshot's champion."""
    from leap_io.paths import state_dir

    gate_file = state_dir() / "demo-prompts.jsonl"
    gate_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    os.environ.setdefault("LEAP_GATE_PROMPTS", str(gate_file))
    os.environ.setdefault("LEAP_MAX_TOKENS", str(max_tokens))
    os.environ.setdefault("LEAP_MIN_ROWS", str(max(50, len(prompts) // 2)))
    os.environ.setdefault("LEAP_REPLAY_SLICE", str(max(8, len(prompts) // 5)))
    os.environ.setdefault("LEAP_FIT_ANCHOR", "champion")


def run_demo(n_prompts: int = 240, max_tokens: int = 1024, concurrency: int = 256, keep_serving: bool = False,
             max_prompt_chars: int = 600, first_champion: str = "none",
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole loop once and return the summary the README promises."""
    if first_champion not in FIRST_CHAMPIONS:
        raise ValueError(f"first_champion must be one of {FIRST_CHAMPIONS}, not {first_champion!r}")
    started = time.time()
    say = progress or (lambda message: None)
    from harness.model_prep import prepare_model

    say("preparing the model")
    model = prepare_model()
    prompts = demo_prompts(n_prompts, max_prompt_chars)
    demo_environment(prompts, max_tokens)

    from flows.pipeline import fit_flow, gate_flow, ingest_flow, push_flow
    from flows.settings import PipelineSettings
    from leap_io.pidfiles import service_pid
    from ops import stack
    from store.stores import open_store

    settings = PipelineSettings()
    os.environ.setdefault("LEAP_ENDPOINTS", f"http://{settings.stack_host}:{settings.admin_port}")
    settings = PipelineSettings()
    if first_champion == "snapshot":
        say("registering the first champion, fitted on the committed corpus snapshot")
        bootstrap = bootstrap_champion(settings.mlflow_tracking_uri, model, max_tokens, prompts)
        candidates = bootstrap.get("recipe_candidates")
    else:
        candidates = capture_candidates(model)
        bootstrap = {"status": "none", "reason": "a first deployment: serving starts on FCFS",
                     "recipe_candidates": list(candidates) if candidates else None}
    if candidates:  # the replica captures every candidate; serving finds the champion under their layer
        os.environ.setdefault("LEAP_RECIPES", ",".join(candidates))
    os.environ.setdefault("LEAP_REGISTRY_URI", settings.mlflow_tracking_uri)  # serving loads the champion
    was_running = service_pid(settings.stack_dir, "serving") is not None
    say("starting the serving process (vLLM + LEAP)")
    stack.up(settings, ["serving"])
    summary: dict[str, Any] = {"model": model.model_id, "model_fingerprint": model.fingerprint,
                               "first_champion": first_champion, "bootstrap": bootstrap}
    try:
        say(f"sending {len(prompts)} real prompts as traffic")
        base_url = f"http://{settings.stack_host}:{settings.serving_port}/v1"
        traffic = asyncio.run(_send_traffic(base_url, os.path.basename(model.path), prompts, max_tokens,
                                            concurrency, None))
        summary["traffic"] = traffic
        admin = f"http://{settings.stack_host}:{settings.admin_port}"
        AdminClient(admin, settings.token(), timeout=60).flush_feedback().raise_for_status()

        say("ingesting feedback into DuckDB")
        ingest = ingest_flow()
        say("fitting and registering a readout in MLflow")
        fit = fit_flow()
        if fit.get("status") not in ("fitted", "reused"):
            raise RuntimeError(f"fit did not produce a readout: {fit}")
        say("gating the challenger against " + ("FCFS" if first_champion == "none" else "FCFS and the champion")
            + " on the step clock, counterbalanced")
        gate = gate_flow(version=fit["version"], name=fit["name"])
        verdict = gate.get("verdict") or {}
        push: dict[str, Any] = {"status": "not-pushed"}
        if verdict.get("passed"):
            say("pushing and promoting the challenger")
            push = push_flow(version=fit["version"], name=fit["name"], promote=True)
        served = AdminClient(admin, settings.token(), timeout=30).readout().json()
        store = open_store(settings)
        counts, capped = store.counts(), _capped_fraction(store)
    finally:
        if not keep_serving and not was_running:
            stack.down(settings, ["serving"])
    results = gate.get("results") or {}
    summary.update(
        ingested_rows=int(counts.get("requests", ingest.get("accepted", 0))),
        max_tokens=max_tokens, capped_fraction=capped,
        quarantined_rows=int(counts.get("quarantine", ingest.get("quarantined", 0))),
        model_version=str(fit["version"]), registered_model=fit["name"],
        gate=gate_summary(verdict, results),
        gate_verdict=verdict.get("reason"), promoted=push.get("status") == "promoted",
        pushed=push.get("status") == "promoted" and served.get("version") == _served_version(push),
        serving_version=served.get("version"), seconds=round(time.time() - started, 1),
        mlflow_ui=f"{os.path.dirname(sys.executable)}/mlflow ui --backend-store-uri "
                  f"{settings.mlflow_sqlite_uri} --port 5000",
    )
    return summary


def gate_summary(verdict: dict, results: dict) -> dict[str, Any]:
    """The gate's outcome, paired mean PTL ratio and its interval, the step clock's error, and each arm's
    mean PTL (step-clock seconds per token, over every repeat)."""
    step_model = verdict.get("step_model") or {}
    return {"outcome": verdict.get("outcome"), "ratio": verdict.get("mean_ptl_ratio"),
            "ci_low": verdict.get("ci_low"), "ci_high": verdict.get("ci_high"), "bar": verdict.get("bar"),
            "passed": bool(verdict.get("passed")), "repeats": verdict.get("repeats"),
            "n_requests": verdict.get("n_requests"),
            "step_model_error_median": step_model.get("median_abs_rel_error"),
            "arms": {policy: {"mean_ptl": figures.get("mean_ptl")} for policy, figures in results.items()}}


def _capped_fraction(store: Any) -> float | None:
    """Share of the ingested outputs that reached the budget (the demo keeps it near or below 10%)."""
    reasons = store.finish_reasons()
    total = sum(reasons.values())
    return round(reasons.get("length", 0) / total, 4) if total else None


def _served_version(push: dict) -> str | None:
    pushed = push.get("pushed") or []
    return pushed[0].get("version") if pushed else None
