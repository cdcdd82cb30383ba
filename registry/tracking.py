"""The tracking store behind a registry URI: where a sqlite store's file is, and its schema made once."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

_ensured_uris: set[str] = set()
_ensure_guard = threading.Lock()


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///relative` or `sqlite:////absolute` URI; None otherwise."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix):].split("?", 1)[0]
    return Path(path) if path else None


def ensure_db(tracking_uri: str) -> None:
    """Create or upgrade a sqlite MLflow schema once, under a file lock, before concurrent use.

    MLflow creates missing tables lazily in each process; two processes doing that on a new file at
    once collide. Non-sqlite URIs are left to their server.
    """
    db_path = sqlite_path(tracking_uri)
    if db_path is None:
        return
    db_path = db_path.resolve()
    key = str(db_path)
    with _ensure_guard:
        if key in _ensured_uris and db_path.exists():
            return
        from mlflow.store.db import utils as db_utils

        db_path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db_path}"
        with open(db_path.with_name(db_path.name + ".lock"), "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                engine = db_utils.create_sqlalchemy_engine(uri)
                try:
                    if db_utils._is_empty_database(engine):
                        db_utils._initialize_tables(engine)
                    elif db_utils._get_schema_version(engine) != db_utils._get_latest_schema_revision():
                        db_utils._upgrade_db(engine)
                finally:
                    engine.dispose()
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        _ensured_uris.add(key)
