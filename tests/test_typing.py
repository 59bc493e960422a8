"""The package type-checks: ``mypy`` with the configuration in pyproject.toml (``[tool.mypy]``: every
module checked, the public API fully annotated) finds nothing, so a type error fails the suite as
it fails CI (``.ci/run``). Slow: a check without mypy's cache takes a minute or more."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_finds_no_type_error(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (it comes with the test extra)")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"mypy found type errors:\n{done.stdout}{done.stderr}"
