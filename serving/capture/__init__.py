"""Hidden-state capture: the worker side that pools layer-L states into one vector per request, and the
engine-core side that receives those vectors.

Workers import torch and vLLM through this package; engine-core imports only `receiver`.
"""
