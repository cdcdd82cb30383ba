"""Both stores and both writers answer their protocols with the protocols' parameters, and the SQL they
share is spelled for each engine."""

from __future__ import annotations

import inspect

import pytest

from store.duckdb import SCHEMA_DDL as DUCKDB_DDL
from store.duckdb import LogStore
from store.duckdb_writer import DuckDBWriter
from store.postgres import SCHEMA_DDL as POSTGRES_DDL
from store.postgres import PostgresStore
from store.postgres_writer import PostgresWriter
from store.protocol import Store, StoreWriter
from store.sql import DUCKDB, POSTGRES, frame_query, selection


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value)]


@pytest.mark.parametrize(("protocol", "implementation"), [
    (Store, LogStore), (Store, PostgresStore), (StoreWriter, DuckDBWriter), (StoreWriter, PostgresWriter)])
def test_every_protocol_method_is_implemented_with_its_parameters(protocol: type, implementation: type) -> None:
    for name in _methods(protocol):
        wanted = list(inspect.signature(getattr(protocol, name)).parameters)
        assert list(inspect.signature(getattr(implementation, name)).parameters) == wanted, name


def test_the_shared_selection_is_spelled_for_each_engine() -> None:
    where, params = selection(DUCKDB, since=1, domains=["a"], layer=3, recipe="last@3")
    assert where == (" WHERE r.arrival_time >= ? AND list_contains(?::VARCHAR[], r.domain) AND f.layer = ? "
                     "AND coalesce(f.recipe, 'last@' || CAST(f.layer AS VARCHAR)) = ?")
    assert params == [1.0, ["a"], 3, "last@3"]
    where, _ = selection(POSTGRES, domains=["a"], model_fingerprint="fp")
    assert where == " WHERE r.domain = ANY(%s) AND f.model_fingerprint = %s"
    assert frame_query(POSTGRES, "f.feature", "").endswith('ORDER BY r.arrival_time, r.request_id COLLATE "C"')
    assert frame_query(DUCKDB, "f.feature", "").endswith("ORDER BY r.arrival_time, r.request_id")


def test_each_engine_spells_the_shared_tables_with_its_own_types() -> None:
    duckdb_ledger = next(ddl for ddl in DUCKDB_DDL if "ingest_ledger" in ddl)
    postgres_ledger = next(ddl for ddl in POSTGRES_DDL if "ingest_ledger" in ddl)
    assert "segment VARCHAR PRIMARY KEY" in duckdb_ledger and "segment TEXT PRIMARY KEY" in postgres_ledger
    assert duckdb_ledger.replace("VARCHAR", "TEXT") == postgres_ledger
