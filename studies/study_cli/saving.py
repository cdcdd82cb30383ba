"""Saving a result to docs/results/: only from a clean checkout, stamped with what produced it.

A published result names the code and the corpus snapshot behind it (`study_harness.snapshot.provenance`). The
check runs when the command starts (the `--save` option's callback), not after hours of work, and the
commit it saw is kept: a result names the code its run started from even if the checkout moves on while
it runs (`commit_at_end` says so).
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

import typer

STARTED: dict[str, str] = {}  # the commit the command started from


def clean_tree(save: bool) -> bool:
    """The `--save` option's callback: refuse a checkout whose tracked files differ from its commit."""
    from study_harness.snapshot import git_commit

    commit = STARTED["commit"] = git_commit()
    if save and commit.endswith("-dirty"):
        raise typer.BadParameter(f"tracked files differ from {commit[:12]}: commit them (or stash) before "
                                 "saving a result, so it names the code that produced it")
    return save


SAVE = typer.Option(False, "--save", callback=clean_tree,
                    help="also write the result to docs/results/ for `leap eval report` (from a clean checkout)")


def stamped(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with its provenance (corpus hash, commit) and the command line that produced it."""
    from study_harness.snapshot import provenance

    source = provenance()
    if STARTED.get("commit") and source["commit"] != STARTED["commit"]:
        source.update(commit=STARTED["commit"], commit_at_end=source["commit"])
    return {**result, **source, "command": "leap " + shlex.join(sys.argv[1:])}
