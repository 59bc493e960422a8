"""Benchmarks: the solver recipes side by side."""
