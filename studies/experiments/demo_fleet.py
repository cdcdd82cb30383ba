"""The main job on a fleet: several CPU replicas feeding one bucket, one store and one registry.

`leap demo --replicas N` runs, on this machine, the loop a platform team runs on a fleet (docs/infra.md):

1. the fleet's servers (`leap stack up --fleet`): PostgreSQL (the log store and MLflow's tracking store),
   moto's S3 server (the replicas' feedback and MLflow's artifacts) and MLflow on them;
2. a first champion fitted on the committed corpus snapshot, which every replica takes as it starts;
3. real prompts sent round-robin to the replicas; each folds its finished requests into its own RLS and
   ships its feedback segments to its own prefix of the bucket;
4. ingest of every replica's prefix (the flow fans out over segments) into the PostgreSQL store;
5. the fleet merge: the replicas' RLS states merged into one exact anchored solve, registered and pushed
   to every replica; its distance to the one-shot anchored ridge refit on the rows the replicas folded
   (read back from the store) is `merged_rls_max_abs_diff`;
6. a second wave of traffic and one pass of the drift watch over every replica (`drift_events`,
   `rollbacks`: findings on the replicas' live error per domain, and readouts put back);
7. a replica killed with SIGKILL, and started again: it takes the champion, and every request that
   finished has its row in the store (`rows_lost`);
8. fit, gate by live replay and promotion to every replica (the single-machine loop's flows).

Every step is the production code path; only the sizes are small. The flows run in this process (Prefect's
ephemeral API), so the fleet's Prefect server and workers are not started here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from leap_io.admin_client import AdminClient

FLEET_SERVICES = ("postgres", "s3", "mlflow")
"""The fleet's servers the demo starts besides its replicas (the flows run in-process)."""


def _flush(admin: str, token: str) -> dict[str, Any]:
    """Close the replica's open segment and ship what it holds to the bucket."""
    response = AdminClient(admin, token, timeout=120).flush_feedback()
    response.raise_for_status()
    return response.json()


def _traffic(settings: Any, layout_replicas: int, model_name: str, prompts: list[dict], max_tokens: int,
             concurrency: int) -> dict[str, Any]:
    """Send the prompts round-robin to the replicas' OpenAI APIs, all at once."""
    from experiments.demo import _send_traffic
    from ops.stack_fleet import replica_ports

    async def all_replicas() -> list[dict]:
        jobs = []
        for index in range(layout_replicas):
            share = prompts[index::layout_replicas]
            port = replica_ports(settings, index)[0]
            jobs.append(_send_traffic(f"http://{settings.stack_host}:{port}/v1", model_name, share, max_tokens,
                                      max(1, concurrency // layout_replicas), None))
        return await asyncio.gather(*jobs)

    results = asyncio.run(all_replicas())
    return {"sent": sum(r["sent"] for r in results), "failed": sum(r["failed"] for r in results),
            "failures": [f for r in results for f in r["failures"]][:5]}


def _merge_refit_diff(settings: Any, store: Any, merge: dict[str, Any]) -> float | None:
    """max |theta_merged - theta_refit|, the refit on the training rows the merged replicas folded.

    Before the merge the store holds exactly the first wave, every row of which the replicas folded
    (the merge folds what waits for a batch first), so the refit reads them all back from the store."""
    from flows.fleet import merge_refit_diff
    from leap_core.recipes import Recipe
    from leap_io.feedback_schema import TRAINING_FINISH_REASONS
    from registry.client import ReadoutRegistry

    if merge.get("status") != "merged":
        return None
    registry = ReadoutRegistry(settings.mlflow_tracking_uri)
    name, version = merge["name"], merge["version"]
    readout = registry.load_readout(name, version)
    _, fingerprint, layer, recipe = store.latest_feature_space()
    frame = store.training_frame(model_fingerprint=fingerprint, layer=layer, recipe=recipe)
    keep = np.isin(frame.finish_reason, TRAINING_FINISH_REASONS)
    capture = Recipe.parse(recipe)
    columns = Recipe.parse(readout.metadata.get("recipe") or capture).columns(
        capture, capture.hidden_for(frame.features.shape[1]))
    return merge_refit_diff(registry, name, version, frame.features[keep][:, columns],
                            frame.output_tokens[keep])


def _kill_and_restart(settings: Any, rid: str) -> dict[str, Any]:
    """SIGKILL a replica's whole process group (engine core included), then start it again."""
    from leap_io.pidfiles import pid_file, service_pid
    from ops import stack

    pid = service_pid(settings.stack_dir, rid)
    if pid is None:
        return {"replica": rid, "killed": False}
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while stack.group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    pid_file(settings.stack_dir, rid).unlink(missing_ok=True)
    started = time.monotonic()
    stack.up(settings, [rid])
    return {"replica": rid, "killed": True, "restart_s": round(time.monotonic() - started, 1)}


def _wait_versions(endpoints: list[str], token: str, want: str | None,
                   timeout_s: float = 120.0) -> dict[str, str | None]:
    """The versions the replicas report, once all report `want` (or the timeout passes)."""
    from flows.fleet import replica_versions
    from leap_io.model_identity import serves

    deadline = time.monotonic() + timeout_s
    while True:
        versions = replica_versions(endpoints, token)
        if want is not None and all(v is not None and serves(v, want) for v in versions.values()):
            return versions
        if time.monotonic() > deadline:
            return versions
        time.sleep(1.0)


def run_fleet_demo(replicas: int = 2, n_prompts: int = 160, max_tokens: int = 1024, concurrency: int = 128,
                   keep_serving: bool = False, max_prompt_chars: int = 600,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the fleet loop once and return its summary (the keys `leap demo --replicas N --json` prints)."""
    started = time.time()
    say = progress or (lambda message: None)
    from experiments.demo import demo_environment, demo_prompts
    from harness.model_prep import prepare_model

    say("preparing the model")
    model = prepare_model()
    pool = demo_prompts(n_prompts + max(8, n_prompts // 4), max_prompt_chars)
    prompts, second_wave = pool[:n_prompts], pool[n_prompts:]
    demo_environment(prompts, max_tokens)
    # the watch judges windows of this many finished requests per replica; the demo's waves are small
    os.environ.setdefault("LEAP_DRIFT_MIN_ROWS", str(max(8, len(second_wave) // (2 * replicas))))

    from experiments.demo import _capped_fraction, bootstrap_champion, gate_summary
    from flows.drift import base_version, drift_flow
    from flows.fleet import merge_flow, replica_versions
    from flows.pipeline import fit_flow, gate_flow, ingest_flow, push_flow
    from flows.settings import PipelineSettings
    from ops import stack
    from ops import stack_fleet as fleet
    from ops.fleet_env import apply_environment
    from store.stores import open_store

    settings = PipelineSettings()
    say(f"starting the fleet's servers: {', '.join(FLEET_SERVICES)}")
    stack.up(settings, list(FLEET_SERVICES), fleet=replicas)
    apply_environment()
    os.environ.pop("PREFECT_API_URL", None)  # the flows run in this process; the fleet's Prefect is not started
    settings = PipelineSettings()
    rids = [fleet.replica_id(index) for index in range(replicas)]
    endpoints = list(settings.endpoints)
    token = settings.token()
    summary: dict[str, Any] = {"replicas": replicas, "model": model.model_id, "store": "postgresql",
                               "feedback_url": settings.feedback_url}
    try:
        say("registering the first champion, fitted on the committed corpus snapshot")
        bootstrap = bootstrap_champion(settings.mlflow_tracking_uri, model, max_tokens, prompts + second_wave)
        summary["bootstrap"] = {k: bootstrap.get(k) for k in ("status", "name", "version", "recipe")}
        if bootstrap.get("recipe_candidates"):
            os.environ.setdefault("LEAP_RECIPES", ",".join(bootstrap["recipe_candidates"]))
        os.environ.setdefault("LEAP_REGISTRY_URI", settings.mlflow_tracking_uri)  # a starting replica's champion
        say(f"starting {replicas} serving replicas (vLLM + LEAP)")
        stack.up(settings, rids)
        champion = _wait_versions(endpoints, token, bootstrap.get("version") and _champion_readout(settings, bootstrap))
        summary["versions_at_start"] = champion

        say(f"sending {len(prompts)} real prompts round-robin to {replicas} replicas")
        model_name = os.path.basename(model.path)
        summary["traffic"] = _traffic(settings, replicas, model_name, prompts, max_tokens, concurrency)
        summary["flushed"] = {rid: _flush(url, token).get("shipper", {}).get("segments_shipped")
                              for rid, url in zip(rids, endpoints)}
        say("ingesting every replica's feedback from the bucket into PostgreSQL")
        ingest = ingest_flow()
        store = open_store(settings)
        say("merging the replicas' RLS states and pushing the merge to every replica")
        merge = merge_flow()
        diff = _merge_refit_diff(settings, store, merge)

        victim = rids[-1]
        say(f"a second wave of {len(second_wave)} prompts, then SIGKILL {victim} and start it again")
        wave2 = _traffic(settings, replicas, model_name, second_wave, max_tokens, concurrency)
        say("one pass of the drift watch over every replica")
        drift = drift_flow()
        time.sleep(3.0)  # the writer fsyncs its open segment within a second of a request finishing
        restart = _kill_and_restart(settings, victim)
        restart["versions"] = _wait_versions(endpoints, token, merge.get("readout_version"))
        for url in endpoints:
            _flush(url, token)
        ingest2 = ingest_flow()
        finished = summary["traffic"]["sent"] - summary["traffic"]["failed"] + wave2["sent"] - wave2["failed"]
        counts = store.counts()

        say("fitting and registering a readout in MLflow")
        fit = fit_flow()
        gate: dict[str, Any] = {}
        push: dict[str, Any] = {"status": "not-pushed"}
        if fit.get("status") in ("fitted", "reused"):
            say("gating the challenger: FCFS, champion, challenger on the step clock, counterbalanced")
            gate = gate_flow(version=fit["version"], name=fit["name"])
            if (gate.get("verdict") or {}).get("passed"):
                say("promoting the challenger to every replica")
                push = push_flow(version=fit["version"], name=fit["name"], promote=True)
        versions = replica_versions(endpoints, token)
        capped = _capped_fraction(store)
    finally:
        if not keep_serving:
            stack.down(settings, None)
    # the readout each replica serves; its own online RLS correction of it shows as "+rls<n>" until the next
    # merge folds the corrections together, so the versions compare without it
    served = {url: None if v is None else base_version(v) for url, v in versions.items()}
    reported = [v for v in served.values() if v is not None]
    summary.update(
        versions=served, versions_equal=len(reported) == len(served) and len(set(reported)) == 1,
        serving_versions=versions,
        rows_ingested=int(counts.get("requests", 0)),
        requests_finished=int(finished), rows_lost=max(0, int(finished) - int(counts.get("requests", 0))),
        merged_rls_max_abs_diff=diff,
        merge={k: merge.get(k) for k in ("status", "version", "readout_version", "rows_merged", "replicas_merged",
                                         "rows_buffered", "versions_equal")},
        restart=restart, second_wave=wave2,
        ingest_rows_per_s=ingest.get("rows_per_s"), ingest={"first": _ingest_brief(ingest),
                                                            "after_restart": _ingest_brief(ingest2)},
        drift_events=int(drift.get("drift_events", 0)), rollbacks=int(drift.get("rollbacks", 0)),
        drift_observations=len(drift.get("observations") or []),
        drift_decisions=drift.get("decisions"),
        model_version=str(fit.get("version")), registered_model=fit.get("name"),
        gate=gate_summary(gate.get("verdict") or {}, gate.get("results") or {}),
        gate_verdict=(gate.get("verdict") or {}).get("reason"), promoted=push.get("status") == "promoted",
        capped_fraction=capped, seconds=round(time.time() - started, 1))
    return summary


def _champion_readout(settings: Any, bootstrap: dict[str, Any]) -> str | None:
    """The readout version of the bootstrap champion (what a replica reports while serving it)."""
    from registry.client import ReadoutRegistry

    readout = ReadoutRegistry(settings.mlflow_tracking_uri).load_readout(bootstrap["name"], bootstrap["version"])
    return readout.metadata.get("version")


def _ingest_brief(ingest: dict[str, Any]) -> dict[str, Any]:
    keep = ("segments", "rows_read", "accepted", "quarantined", "duplicates", "rows_per_s", "workers")
    return {key: ingest.get(key) for key in keep if key in ingest}
