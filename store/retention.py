"""Ingested segments removed from the feedback location once they are old enough, so listing it stays short.

A segment is removed only when all its rows are in the store: the store recorded it ingested (`ok`) at
least `older_than_s` seconds ago, under the stamp the segment has now (`store.ingest`: a segment whose
size, modification time or ETag changed since is new content, and is kept). Unreadable, failed and
changed segments are kept too: they hold rows the store does not have, for a repair and `retry_failed`.
The store keeps their ledger rows and stamps, so a segment removed is never mistaken for a new one.
A source that cannot be removed (gone meanwhile, refused) is left, and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from store.ingest import STATUS_OK, SegmentSource, stamp_of
from store.protocol import Store

logger = logging.getLogger(__name__)


def prune_ingested(store: Store, sources: Sequence[SegmentSource], *, older_than_s: float,
                   now: datetime | None = None) -> dict[str, int]:
    """Remove the `sources` (`store.ingest.complete_segments`) whose rows are all in `store` and were
    ingested at least `older_than_s` seconds before `now`; counts of removed, kept and failed removals."""
    if older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    now = (now or datetime.now(UTC)).replace(tzinfo=None)
    ingested = {row["segment"]: row for row in store.ledger() if row["status"] == STATUS_OK}
    stamps = store.stamps()
    counts = {"removed": 0, "kept_new_or_changed": 0, "kept_recent": 0, "kept_not_ingested": 0, "remove_failed": 0}
    for source in sources:
        segment = source.segment
        row = ingested.get(segment)
        stamp = stamp_of(source)
        known = stamps.get(segment)
        if row is None or known is None or known[2] != STATUS_OK or known[1] != row["checksum"]:
            counts["kept_not_ingested"] += 1
        elif stamp is None or known[0] != stamp:
            counts["kept_new_or_changed"] += 1
        elif (now - _naive(row["ingested_at"])).total_seconds() < older_than_s:
            counts["kept_recent"] += 1
        else:
            try:
                source.remove()
                counts["removed"] += 1
            except (OSError, RuntimeError) as error:  # gone meanwhile, or refused: left for the next run
                counts["remove_failed"] += 1
                logger.warning("could not remove ingested segment %s: %s", segment, error)
    return counts


def _naive(value: Any) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=None) if value.tzinfo else value
