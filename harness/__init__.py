"""The engine harness: an in-process engine, replay of real traffic, the corpus builder, prompt sets and
model preparation, shared by the gate, the studies and the benchmarks. Not needed to serve.
"""
