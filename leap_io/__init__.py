"""The files and folders LEAP's processes exchange: state folders, model identity, the feedback segment
schema and the push bundle. No vLLM here, so flows and the registry read them without the engine.
"""
