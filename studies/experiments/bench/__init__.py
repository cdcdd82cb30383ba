"""Benchmarks that print figures: serving against stock vLLM, overhead, predictor, ingest and pipeline."""
