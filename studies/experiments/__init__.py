"""Experiment code around the product: the demos, the fault suite and the benchmarks. It calls the flows, never
their tasks."""
