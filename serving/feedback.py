"""Append-only feedback segments: one Parquet row per finished request, written exactly once.

Rows go to a writer thread so the scheduler never waits on the disk. The open segment is an Arrow IPC
stream (`*.arrows.partial`), appended one record batch per flush and flushed to the OS each time, so a
crash leaves a readable prefix. Rotation (by rows or age) and shutdown convert the stream to
`*.parquet` via a temporary name and an atomic rename: readers only ever see complete segments.
On start, a leftover stream from a crash is recovered up to its last complete batch; the number of
rows recovered and whether a torn tail was dropped are logged and returned.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from leap_io.feedback_schema import feedback_schema, segment_metadata

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".arrows.partial"


def _to_parquet(table: pa.Table, final: Path) -> None:
    tmp = final.with_name(final.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, final)


def recover_partial(partial: Path) -> tuple[int, bool]:
    """Turn a crashed stream into a Parquet segment; (rows recovered, torn tail dropped)."""
    batches, torn = [], False
    schema = None
    try:
        with pa.OSFile(str(partial), "rb") as source:
            reader = ipc.open_stream(source)
            schema = reader.schema
            while True:
                try:
                    batches.append(reader.read_next_batch())
                except StopIteration:
                    break
    except (pa.ArrowInvalid, OSError, EOFError):
        torn = True
    rows = sum(len(b) for b in batches)
    if schema is not None and rows:
        final = partial.with_name(partial.name[: -len(PARTIAL_SUFFIX)] + ".parquet")
        _to_parquet(pa.Table.from_batches(batches, schema=schema), final)
    partial.unlink()
    return rows, torn


class FeedbackWriter:
    """Writes finished-request rows to rotating segments from a background thread."""

    def __init__(self, folder: str | Path, dim: int, layer: int, model_id: str, fingerprint: str,
                 max_rows: int = 5000, max_seconds: float = 300.0, flush_rows: int = 64,
                 flush_seconds: float = 1.0) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.schema = feedback_schema(dim).with_metadata(segment_metadata(dim, layer, model_id, fingerprint))
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self.recovered_rows, self.torn_segments = 0, 0
        for partial in sorted(self.folder.glob("*" + PARTIAL_SUFFIX)):
            rows, torn = recover_partial(partial)
            self.recovered_rows += rows
            self.torn_segments += int(torn)
            logger.warning("feedback: recovered %d rows from %s after a crash%s", rows, partial.name,
                           " (a torn last batch was dropped)" if torn else "")
        self.rows_written = 0
        self.segments_closed = 0
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._buffer: list[dict[str, Any]] = []
        self._writer: ipc.RecordBatchStreamWriter | None = None
        self._sink: pa.OSFile | None = None
        self._partial: Path | None = None
        self._segment_rows = 0
        self._segment_started = 0.0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leap-feedback", daemon=True)
        self._thread.start()

    def write(self, row: dict[str, Any]) -> None:
        """Queue one finished request's row (never blocks)."""
        self._queue.put(row)

    def close(self, timeout: float = 30.0) -> None:
        """Flush everything and close the open segment as Parquet."""
        self._queue.put(None)
        self._thread.join(timeout)

    def flush(self, timeout: float = 10.0) -> None:
        """Close the open segment now so everything written so far is readable as Parquet."""
        done = threading.Event()
        self._queue.put({"__rotate__": done})
        done.wait(timeout)

    # -- writer thread -----------------------------------------------------------------------------
    def _open(self) -> None:
        name = f"feedback-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._partial = self.folder / (name + PARTIAL_SUFFIX)
        self._sink = pa.OSFile(str(self._partial), "wb")
        self._writer = ipc.new_stream(self._sink, self.schema)
        self._segment_rows = 0
        self._segment_started = time.monotonic()

    def _flush_buffer(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            self._open()
        scalars = [name for name in self.schema.names if name != "feature"]
        arrays = [pa.array([row.get(name) for row in self._buffer], type=self.schema.field(name).type)
                  for name in scalars]
        dim = self.schema.field("feature").type.list_size
        flat = np.concatenate([np.asarray(row["feature"], dtype=np.float32).reshape(dim)
                               for row in self._buffer])
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), dim))
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        self._writer.write_batch(batch)
        self._sink.flush()
        self._segment_rows += len(self._buffer)
        self.rows_written += len(self._buffer)
        self._buffer.clear()

    def _rotate(self) -> None:
        self._flush_buffer()
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        self._writer = self._sink = None
        partial = self._partial
        recover_partial(partial)  # the stream is complete; this converts it to Parquet
        self.segments_closed += 1

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.flush_seconds)
            except queue.Empty:
                item = {}
            if item is None:
                self._rotate()
                self._closed.set()
                return
            if "__rotate__" in item:
                self._rotate()
                item["__rotate__"].set()
                continue
            if item:
                self._buffer.append(item)
            now = time.monotonic()
            if len(self._buffer) >= self.flush_rows or (self._buffer and now - last_flush >= self.flush_seconds):
                try:
                    self._flush_buffer()
                except Exception:  # keep serving; the rows stay buffered for the next try
                    logger.exception("feedback: flush failed")
                last_flush = now
            if self._writer is not None and (self._segment_rows >= self.max_rows
                                             or now - self._segment_started >= self.max_seconds):
                self._rotate()
