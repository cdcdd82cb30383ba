"""The experiment harness around the plugin: an in-process engine, replay of real traffic, the corpus
builder, prompt sets, model preparation and the benchmarks. Not needed to serve.
"""
