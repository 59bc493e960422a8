"""Solving Q/K: ``SolveConfig`` and its key, the solver recipes, the safetensors artifact, the cache, ``solve()``."""
