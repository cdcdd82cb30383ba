"""Feedback segments in a bucket, as sources `store.ingest` reads like local files.

The replicas' shippers (serving/feedback/shipper.py) upload each complete segment to
`<prefix>/<replica id>/<segment name>`; `object_segments` lists them with the same rules
`store.ingest.complete_segments` applies to a local folder: `*.parquet` objects at the prefix's top level
and one folder down, never hidden names, deeper keys or `quarantine/`; top-level objects first by name,
then each replica folder's by name. Listing is paginated (`ObjectStore.list`), and an object is read
only when ingest reaches it (on its read-ahead thread), so a long listing never holds every segment in
memory. An object deleted between the listing and the read counts as vanished, like a local file.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from leap_io.object_store import ObjectNotFound, ObjectStore
from leap_io.s3_locations import check_endpoint, parse_s3_url

logger = logging.getLogger(__name__)

_QUARANTINE = "quarantine"


_STORES: dict[str | None, ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def store_at(endpoint_url: str | None) -> ObjectStore:
    """One client per endpoint for the process (boto3 clients are thread-safe; making one costs ~50 ms).
    None means `LEAP_S3_ENDPOINT_URL` as it is now (else AWS)."""
    if endpoint_url is None:
        from leap_io.settings import read_settings

        endpoint_url = read_settings().s3_endpoint_url
    endpoint_url = check_endpoint(endpoint_url)
    with _STORES_LOCK:
        store = _STORES.get(endpoint_url)
        if store is None:
            store = _STORES[endpoint_url] = ObjectStore(endpoint_url)
        return store


@dataclass(frozen=True)
class ObjectSegment:
    """One segment object; `store.ingest.SegmentSource` for a bucket. Plain values only, so it pickles
    (a task in another process can read it); the client comes from `store_at(endpoint_url)`."""

    bucket: str
    key: str
    replica_id: str | None = None
    endpoint_url: str | None = None
    size: int | None = None  # from the listing
    etag: str | None = None  # from the listing

    @property
    def stamp(self) -> str | None:
        """Size and ETag as listed (a new upload at the key changes the ETag); None when not listed so."""
        return f"s3:{self.size}:{self.etag}" if self.etag and self.size is not None else None

    @property
    def segment(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def read_bytes(self) -> bytes:
        """The object's bytes; `ObjectNotFound` (a FileNotFoundError) when it is gone."""
        return store_at(self.endpoint_url).get(self.bucket, self.key)

    def remove(self) -> None:
        store_at(self.endpoint_url).delete(self.bucket, self.key)


def _is_segment_name(name: str) -> bool:
    return name.endswith(".parquet") and not name.startswith(".")


def object_segments(url: str, *, endpoint_url: str | None = None) -> list[ObjectSegment]:
    """The complete segments under `s3://bucket/prefix`, in the order a local folder's are ingested.

    A bucket that does not exist yet (no replica has shipped) holds no segments; any other error of the
    service (down, refused) is raised as `ObjectStoreError`, which ends the run like a local I/O error.
    """
    location = parse_s3_url(url)
    store = store_at(endpoint_url)
    endpoint_url = store.endpoint_url  # resolved (LEAP_S3_ENDPOINT_URL when not given), so it travels
    base = f"{location.prefix}/" if location.prefix else ""
    top: list[ObjectSegment] = []
    nested: list[tuple[str, str, ObjectSegment]] = []
    try:
        for info in store.list(location.bucket, base):
            parts = info.key[len(base):].split("/")
            if len(parts) == 1 and _is_segment_name(parts[0]):
                top.append(ObjectSegment(location.bucket, info.key, None, endpoint_url, info.size, info.etag))
            elif (len(parts) == 2 and parts[0] and not parts[0].startswith(".") and parts[0] != _QUARANTINE
                  and _is_segment_name(parts[1])):
                nested.append((parts[0], parts[1],
                               ObjectSegment(location.bucket, info.key, parts[0], endpoint_url, info.size, info.etag)))
    except ObjectNotFound as error:  # listing raises it only for a missing bucket
        logger.warning("no feedback bucket yet (%s): no segments to ingest", error)
        return []
    top.sort(key=lambda source: source.name)
    nested.sort(key=lambda item: (item[0], item[1]))
    return top + [source for _, _, source in nested]

