"""Canary promotion: a gated challenger serves on N replicas first, and their live figures decide.

`canary_promote` pushes the challenger to the first `canaries` replicas of `endpoints` and leaves the rest
on the champion, then ingests feedback every `poll_s` and compares the two groups' labelled rows over the
same window (`leap_core.canary_figures`). Not worse: promoted everywhere, all or nothing
(`flows.promotion.promote`); worse, or too few rows when `window_s` is over: the canaries get the
champion back. Each outcome is recorded in the registry's history (`leap-operations`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flows.promotion import PushOptions, promote
from flows.push import PushFailed, push_readout
from leap_core.canary_figures import canary_figures
from leap_core.metrics import ptl
from leap_io.labels import label_mask
from registry.client import ReadoutRegistry


def split_fleet(endpoints: Sequence[str], canaries: int) -> tuple[list[str], list[str]]:
    """(the canary replicas, the rest): the first `canaries` of the sorted endpoints."""
    ordered = sorted(endpoints)
    if not 1 <= canaries < len(ordered):
        raise ValueError(f"a canary needs 1 <= canaries < replicas; got {canaries} of {len(ordered)}")
    return ordered[:canaries], ordered[canaries:]


def canary_evidence(store: Any, canary_version: str, rest_version: str, since: float, min_rows: int,
                    max_length: int, ptl_bound: float, seed: int = 0) -> dict[str, Any]:
    """The canaries' figures against the rest's over the labelled rows finished after `since`;
    `figures` None (with the reason) while either group has fewer than `min_rows`."""
    rows = store.served_rows([canary_version, rest_version], since)
    labelled = label_mask(rows, max_length) & np.isfinite(rows["predicted"])
    tokens = rows["output_tokens"].astype(np.float64)
    latency = ptl(rows["arrival_time"], rows["finish_time"], rows["output_tokens"])  # stored rows have >= 1 token
    groups = {name: labelled & (rows["readout_version"] == version)
              for name, version in (("canary", canary_version), ("rest", rest_version))}
    counts = {name: int(mask.sum()) for name, mask in groups.items()}
    report: dict[str, Any] = {"since": since, "labelled_rows": counts}
    if min(counts.values()) < min_rows:
        return {**report, "figures": None,
                "reason": f"labelled rows canary {counts['canary']}, rest {counts['rest']}; {min_rows} each needed"}
    figures = canary_figures(*[(tokens[mask], rows["predicted"][mask], latency[mask]) for mask in groups.values()],
                             ptl_bound=ptl_bound, seed=seed)
    return {**report, "figures": figures, "reason": None}


def _push_all(endpoints: Sequence[str], bundle: bytes, expected: str, options: PushOptions) -> list[dict[str, Any]]:
    return [push_readout(endpoint, options.token, bundle, expected, retries=options.retries,
                         timeout=options.timeout, backoff_s=options.backoff_s) for endpoint in endpoints]


def canary_promote(registry: ReadoutRegistry, store: Any, name: str, candidate: str, champion: str,
                   endpoints: Sequence[str], canaries: int, options: PushOptions, journal_dir: str,
                   ingest: Callable[[], Any], *, window_s: float, min_rows: int, poll_s: float, ptl_bound: float,
                   champion_url: str | None = None, clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """Serve `candidate` on `canaries` replicas, judge them against the rest, then promote or roll back
    (module docstring). `ingest` brings the feedback into `store` (called before each look)."""
    canary_endpoints, rest = split_fleet(endpoints, canaries)
    bundle, expected = registry.push_bundle(name, candidate)
    champion_bundle, champion_expected = registry.push_bundle(name, champion, force=True)
    max_length = int(registry.load_readout(name, candidate).max_tokens)
    report: dict[str, Any] = {"name": name, "challenger": candidate, "champion": champion,
                              "canaries": canary_endpoints, "rest": rest, "readout_version": expected}
    try:
        report["canary_pushes"] = _push_all(canary_endpoints, bundle, expected, options)
    except PushFailed as error:
        report["restored"] = _push_all(canary_endpoints, champion_bundle, champion_expected, options)
        return _recorded(registry, {**report, "status": "canary-failed", "reason": f"canary push failed: {error}"})
    since = clock()
    deadline = since + window_s
    while True:
        report["ingest"] = ingest()
        evidence = canary_evidence(store, expected, champion_expected, since, min_rows, max_length, ptl_bound)
        if evidence["figures"] is not None or clock() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - clock())))
    report["evidence"] = evidence
    figures = evidence["figures"]
    if figures is not None and not figures["canary_worse"]:
        report["promotion"] = promote(registry, name, candidate, list(endpoints), options, journal_dir,
                                      champion_url, gated_against=champion)
        reason = (f"canaries not worse on {figures['n_canary']} requests against {figures['n_rest']}: "
                  f"{_summary(figures)}")
        return _recorded(registry, {**report, "status": "promoted", "reason": reason})
    reason = (f"canaries worse on {', '.join(figures['worse_on'])}: {_summary(figures)}" if figures is not None
              else f"too few rows in {window_s:.0f} s: {evidence['reason']}")
    report["restored"] = _push_all(canary_endpoints, champion_bundle, champion_expected, options)
    return _recorded(registry, {**report, "status": "rolled-back", "reason": reason})


def _summary(figures: dict[str, Any]) -> str:
    spearman, ptl = figures["spearman"], figures["mean_ptl"]
    return (f"Spearman {spearman['canary']:.3f} against {spearman['rest']:.3f} (difference "
            f"{spearman['difference']['ci_low']:+.3f} to {spearman['difference']['ci_high']:+.3f}), mean PTL "
            f"x{ptl['ratio']['value']:.3f} ({ptl['ratio']['ci_low']:.3f} to {ptl['ratio']['ci_high']:.3f})")


def _recorded(registry: ReadoutRegistry, report: dict[str, Any]) -> dict[str, Any]:
    action = "canary-promote" if report["status"] == "promoted" else "canary-rollback"
    try:
        report["recorded_run_id"] = registry.log_operation(action, report["reason"], report)
    except Exception as error:
        report["record_error"] = f"{type(error).__name__}: {error}"
    return report
