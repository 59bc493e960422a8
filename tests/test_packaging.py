"""The package as users install it: a built wheel carries the shipped artifacts, and a
non-editable install finds them (the README's default solve is a cache hit)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.slow
def test_wheel_ships_artifacts_and_an_installed_copy_finds_them(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("structinit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("structinit/data/cache/") and n.endswith(".safetensors"))
    in_repo = sorted(p.name for p in (REPO / "structinit" / "data" / "cache").glob("*.safetensors"))
    assert [Path(n).name for n in shipped] == in_repo and in_repo
    # install the wheel (not editable) into its own folder and run the README's solve from there
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(target), STRUCTINIT_CACHE=str(tmp_path / "empty-cache"))
    code = ("import structinit, sys; from structinit.cli.app import main; "
            "assert structinit.__file__.startswith(sys.argv[1]), structinit.__file__; "
            "sys.exit(main(['solve', '--tokens', '256', '--dim', '192', '--heads', '3', '--filter', '3', '--json']))")
    r = subprocess.run([sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cached"] is True and doc["path"].startswith(str(target))
