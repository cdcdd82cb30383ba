"""What the log store answers and what ingest writes through, whichever engine holds it.

`Store` is what readers and ingest are written against: the DuckDB file (`store.duckdb.LogStore`) and
the PostgreSQL database (`store.postgres.PostgresStore`) both answer it, with the same results.
`StoreWriter` is what `store.ingest` writes a segment through, on one connection for a whole run: the
judging of rows (`store.validation`) is the same for every store, only these writes differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Protocol

import numpy as np
import pyarrow as pa

from store.frame import TrainingFrame

SpaceKey = tuple[str, int, str]
"""A feature space: (model fingerprint, layer, capture recipe)."""

Ledger = dict[str, tuple[str, str]]
"""Each segment already ingested, as its (checksum, status)."""

Stamps = dict[str, tuple[str, str, str]]
"""Each segment whose content was checked, as (its stamp then, that content's checksum, its status)."""


class StoreWriter(Protocol):
    """A store's writes of ingested segments, on one connection that `store.ingest` holds for a run.

    The DuckDB file's writer (`store.duckdb_writer`) holds the file's only write lock, so the run's
    `snapshot` stays true. PostgreSQL's (`store.postgres_writer`) shares its store with other workers
    writing at the same time (`concurrent`): there each segment first `claim`s its ledger row under a
    lock that lasts until the transaction ends, and `store_dims` reads the dims stored for the
    segment's feature spaces inside the transaction instead of the run's snapshot.
    `prepare_features` hands over a segment's accepted rows before `insert_requests`, so that a store
    that writes their features elsewhere (the DuckDB store's feature files) starts while the requests
    go in; `insert_requests` returns which rows it inserted: the others are duplicates of ids already
    stored, and `insert_features` stores the features of the inserted ones.
    """

    concurrent: bool
    """Whether other writers may write the store meanwhile (each segment then `claim`s its ledger row)."""

    environment_errors: tuple[type[BaseException], ...]
    """Errors of the environment rather than of a segment (the store gone, its disk full): they end the
    run instead of failing the segment being written."""

    def snapshot(self) -> tuple[Ledger, set[tuple[str, str]], dict[SpaceKey, int]]:
        """(the ledger, the (segment, checksum) contents already quarantined as changed, the dim stored
        for each feature space) as the run starts."""
        ...

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None:
        """Roll back the open transaction; never raises (it runs while another error propagates)."""
        ...

    def claim(self, segment: str, checksum: str) -> tuple[tuple[str, str] | None, bool]:
        """(the segment's ledger row, whether this content is quarantined as changed), now and held."""
        ...

    def stamps(self) -> Stamps:
        """The stamp of each segment when its content was last checked (`store.ingest` skips a segment
        whose stamp is unchanged without reading it)."""
        ...

    def write_stamp(self, segment: str, stamp: str, checksum: str, status: str) -> None: ...

    def clear_segment_quarantine(self, segment: str) -> None: ...

    def store_dims(self, spaces: Sequence[SpaceKey], dim: int | None,
                   known: Mapping[SpaceKey, int]) -> Mapping[SpaceKey, int]: ...

    def release_spaces(self, stored: Mapping[SpaceKey, int]) -> None: ...

    def insert_requests(self, rows: pa.Table, segment: str, now: datetime, replica_id: str | None) -> np.ndarray: ...

    def prepare_features(self, rows: pa.Table, dim: int, segment: str, checksum: str) -> None: ...

    def insert_features(self, rows: pa.Table, inserted: np.ndarray, dim: int, recipe: str | None) -> None: ...

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None: ...

    def quarantine_segment(self, segment: str, reason: str, detail_json: str, now: datetime) -> None: ...

    def write_ledger(self, segment: str, checksum: str, counts: Sequence[int], status: str, now: datetime) -> None: ...

    def record_changed(self, segment: str, checksum: str, ingested_checksum: str, size_bytes: int,
                       now: datetime) -> None: ...


class Store(Protocol):
    """The log store: what the pipeline, the CLI and ingest ask of it, the same on every engine."""

    def schema_version(self) -> int:
        """The version of the store's tables (each engine has its own line of versions)."""
        ...

    def counts(self) -> dict[str, int]:
        """Row counts of every table and the ledger's totals (which reconcile row for row)."""
        ...

    def finish_reasons(self) -> dict[str, int]:
        """How many stored requests finished with each reason."""
        ...

    def changed_segments(self) -> list[dict]:
        """Contents found at an already-ingested segment's path and left out (see `store.ingest`)."""
        ...

    def ledger(self) -> list[dict]:
        """One dict per ingested segment, ordered by its identity (byte order)."""
        ...

    def stamps(self) -> Stamps:
        """The stamp each checked segment had, with that content's (checksum, status)."""
        ...

    def quarantine_reasons(self) -> dict[str, int]:
        """How many quarantined rows each reason holds."""
        ...

    def stored_dims(self) -> dict[SpaceKey, int]:
        """The feature dim stored for each feature space."""
        ...

    def training_frame(self, *, since: float | None = None, until: float | None = None,
                       domains: Sequence[str] | None = None, model_fingerprint: str | None = None,
                       layer: int | None = None, recipe: str | None = None) -> TrainingFrame:
        """Requests with arrival_time in [since, until), optionally only some domains / one feature space."""
        ...

    def latest_feature_space(self, model_fingerprint: str | None = None, layer: int | None = None,
                             recipe: str | None = None) -> tuple[str | None, str, int, str] | None:
        """(model id, fingerprint, layer, recipe) of the most recent feedback, optionally narrowed."""
        ...

    def largest_max_tokens(self, model_fingerprint: str, layer: int, recipe: str) -> int | None:
        """The largest output budget among the stored requests of one feature space."""
        ...

    def newest_since(self, rows: int, *, since: float | None = None, until: float | None = None,
                     domains: Sequence[str] | None = None, model_fingerprint: str | None = None,
                     layer: int | None = None, recipe: str | None = None) -> float | None:
        """The arrival time of the `rows`-th newest row of the selection, or None when it has fewer."""
        ...

    def shadow_rows(self, shadow_version: str, since: float | None = None) -> dict[str, np.ndarray]:
        """The stored rows a readout held in shadow predicted, as arrays (`store.sql.SqlStore.shadow_rows`)."""
        ...

    def served_rows(self, readout_versions: Sequence[str], since: float) -> dict[str, np.ndarray]:
        """The rows finished after `since` while one of `readout_versions` served (the canary's window)."""
        ...

    def recorded_lengths(self, request_ids: Sequence[str],
                         model_fingerprint: str | None = None) -> dict[str, tuple[int, float]]:
        """(output_tokens, arrival_time) of those request ids finished by a training-label reason."""
        ...

    def recorded_gate(self, name: str, challenger: str, champion: str | None) -> dict | None:
        """The latest gate recorded for this challenger against this champion, or None."""
        ...

    def gate_run(self, gate_key: str) -> tuple[bool, str | None]:
        """(whether a gate with this key is recorded, its MLflow run id)."""
        ...

    def record_gate(self, gate_key: str, time: datetime, name: str, challenger: str, champion: str | None,
                    passed: bool, verdict_json: str, results_json: str, run_id: str | None) -> None:
        """Record a gate once (a second record of the same key is ignored)."""
        ...

    def segment_writer(self) -> AbstractContextManager[StoreWriter]:
        """The writer `store.ingest` writes a run's segments through, on a connection of its own."""
        ...
