"""Prefect flows: ingest feedback into DuckDB, fit, gate by live replay, push, retrain."""
