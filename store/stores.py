"""One way to open the log store, whichever engine holds it.

A store location is a string a Prefect task can take as a parameter: a `postgresql+psycopg://` (or
`postgresql://`) URL names the shared PostgreSQL store (`store.postgres`), anything else is the
path of the embedded DuckDB file (`store.duckdb`). Both answer `Store` (`store.protocol`), and
`store.ingest` writes both through the same judging code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from store.duckdb import LogStore
from store.protocol import Store


class StoreSettings(Protocol):
    """Settings that name a log store (the pipeline's settings do)."""

    @property
    def store_url(self) -> str | None:
        """A PostgreSQL URL, or None for the DuckDB file."""
        ...

    @property
    def duckdb_path(self) -> str | Path | None:
        """The DuckDB file, used when `store_url` is None."""
        ...


_POSTGRES_SCHEMES = ("postgresql://", "postgresql+psycopg://", "postgres://")


def is_postgres(location: str | Path) -> bool:
    """Whether a store location names a PostgreSQL database rather than a DuckDB file."""
    return str(location).startswith(_POSTGRES_SCHEMES)


def store_at(location: str | Path) -> Store:
    """The store at `location`: a PostgreSQL URL, or the path of a DuckDB file.

    ValueError for a URL of another database (a `scheme://` that is neither), which would otherwise
    be taken for a file name.
    """
    text = str(location)
    if text.startswith("postgres://"):
        text = "postgresql://" + text[len("postgres://"):]
    if is_postgres(text):
        from store.postgres import PostgresStore

        return PostgresStore(text)
    if "://" in text:
        raise ValueError(f"the log store location {text!r} is neither a DuckDB file path nor a "
                         "postgresql+psycopg:// URL")
    return LogStore(text)


def store_location(settings: StoreSettings) -> str:
    """Where the settings put the store: LEAP_STORE_URL when set, else the DuckDB file."""
    return str(settings.store_url or settings.duckdb_path)


def open_store(settings: StoreSettings) -> Store:
    """The store the settings name (`store_location`)."""
    return store_at(store_location(settings))


def shown_location(settings: StoreSettings) -> str:
    """The store location for messages: the DuckDB path, or the URL without its password."""
    location = store_location(settings)
    if not is_postgres(location):
        return location
    from sqlalchemy.engine import make_url

    return make_url(location).render_as_string(hide_password=True)
