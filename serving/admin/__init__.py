"""The admin HTTP API inside the engine-core process (readout push, health, metrics, kill switch)."""
