"""Package data: pre-solved artifacts for standard shapes (``cache/``), read with importlib.resources."""
