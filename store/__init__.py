"""The log store of finished requests: one `Store` protocol (store/protocol.py), the DuckDB and PostgreSQL
engines, segment validation and the ingest of feedback segments."""
