"""Shared test fixtures: every test gets its own empty user cache; torch uses the 2 cores."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("STRUCTINIT_CACHE", str(cache))
    return cache


@pytest.fixture
def cache_dir(_isolated_cache):
    return _isolated_cache


def run_cli(*args, env=None, cwd=None, timeout=300):
    """Run ``structinit ARGS`` in a subprocess (the real console entry point)."""
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
