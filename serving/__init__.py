"""The vLLM plugin: capture hook, CPU predictor, countdown scheduler, feedback stream, admin API.

Importing this package does not import vLLM; the engine-facing modules do that themselves.
"""
