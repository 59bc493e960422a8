"""Artifact format, cache look-up, corruption handling, concurrency and killed writers."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors import safe_open

from structinit.errors import ArtifactError
from structinit.solver.artifact import read_artifact
from structinit.solver.cache import find_cached, list_artifacts, resolve_key, shipped_cache_dir, user_cache_dir
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve

CFG = SolveConfig(grid=(6, 6), dim=32, heads=4, filter=3, layers=2)


def test_artifact_layout_matches_the_spec(cache_dir):
    res = solve(CFG)
    assert not res.cached and res.artifact.path == cache_dir / CFG.filename
    with safe_open(str(res.artifact.path), "np") as fh:
        meta = fh.metadata()
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    assert set(tensors) == {"q", "k", "offsets", "pseudo_input"}
    assert tensors["q"].shape == (2, 4, 32, 8) and tensors["q"].dtype == np.float32
    assert tensors["k"].shape == (2, 4, 32, 8)
    assert tensors["offsets"].shape == (2, 4, 2) and tensors["offsets"].dtype == np.int32
    assert tensors["pseudo_input"].shape == (36, 32)
    assert meta["format"] == "structinit/1" and meta["key"] == CFG.key
    assert json.loads(meta["config"]) == CFG.to_dict()
    stats = json.loads(meta["stats"])
    assert len(stats["layers"]) == 2 and len(stats["layers"][0]) == 4
    assert set(stats["layers"][0][0]) == {"mse", "hit_rate", "target_mass", "q_norm", "k_norm"}
    assert stats["device"] == "cpu" and stats["seconds"] > 0
    assert meta["version"]


def test_second_call_is_a_cache_hit_with_identical_tensors():
    first = solve(CFG).artifact
    second = solve(CFG)
    assert second.cached
    assert np.array_equal(first.q, second.artifact.q) and np.array_equal(first.k, second.artifact.k)
    forced = solve(CFG, force=True)
    assert not forced.cached and np.array_equal(first.q, forced.artifact.q)


def test_cache_location_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("STRUCTINIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "structinit"
    monkeypatch.setenv("STRUCTINIT_CACHE", str(tmp_path / "env"))
    assert user_cache_dir() == tmp_path / "env"
    assert user_cache_dir(tmp_path / "flag") == tmp_path / "flag"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_artifact_is_reported_and_recomputed(damage):
    original = solve(CFG).artifact
    path = original.path
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flip":
        raw = bytearray(good)
        raw[-5] ^= 0xFF  # a byte inside the tensor data: only the checksum can see it
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError):
        read_artifact(path)
    warnings = []
    res = solve(CFG, warn=warnings.append)
    assert not res.cached and len(warnings) == 1 and "corrupt" in warnings[0]
    again = read_artifact(path)
    assert again.key == CFG.key
    assert np.array_equal(again.q, original.q) and np.array_equal(again.k, original.k)  # bit for bit


def test_shipped_artifacts_are_valid_and_consulted_read_only(cache_dir):
    shipped = sorted(shipped_cache_dir().glob("*.safetensors"))
    assert shipped, "the repository ships pre-solved artifacts in cache/"
    assert sum(p.stat().st_size for p in shipped) < 5 * 2**20
    for p in shipped:
        art = read_artifact(p)
        assert art.stats["summary"]["hit_rate"] == 1.0
        before = p.stat().st_mtime_ns
        res = solve(art.config)
        assert res.cached and res.artifact.path == p and p.stat().st_mtime_ns == before
    assert not cache_dir.exists() or not list(cache_dir.glob("*.safetensors"))


def test_listing_and_key_resolution():
    path = solve(CFG).artifact.path
    assert path in list(list_artifacts())
    assert resolve_key(CFG.key) == path
    assert resolve_key("ffffffffffff") is None


SOLVE_ONE = """
import json, sys
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve
cfg = SolveConfig(grid=(8, 8), dim=64, heads=4, recipe="paper", params={"iters": 400})
r = solve(cfg, cache_dir=sys.argv[1])
print(json.dumps({"cached": r.cached, "key": r.artifact.key}))
"""


@pytest.mark.slow
def test_eight_concurrent_solvers_leave_one_valid_artifact(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", SOLVE_ONE, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(8)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    results = [json.loads(o[0]) for o in outs]
    assert len({r["key"] for r in results}) == 1
    assert sum(not r["cached"] for r in results) == 1  # the lock made the others wait and reuse it
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == [f"n64-d64-h4-f3-{results[0]['key']}.safetensors"]
    assert read_artifact(tmp_path / files[0]).key == results[0]["key"]


WRITE_BIG = """
import sys, numpy as np
from structinit.solver.artifact import Artifact, write_artifact
from structinit.solver.config import SolveConfig
cfg = SolveConfig(grid=(16, 16), dim=768, heads=12, layers=48)
shape = (48, 12, 768, 64)
art = Artifact(config=cfg, q=np.ones(shape, np.float32), k=np.ones(shape, np.float32),
               offsets=np.zeros((48, 12, 2), np.int32), pseudo_input=np.zeros((256, 768), np.float32), stats={})
print("writing", flush=True)
write_artifact(art, sys.argv[1])
"""


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_nothing_that_loads(tmp_path):
    cfg = SolveConfig(grid=(16, 16), dim=768, heads=12, layers=48)
    target = tmp_path / cfg.filename
    proc = subprocess.Popen([sys.executable, "-c", WRITE_BIG, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer never started its temp file"
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not target.exists()  # the partial data is only ever in the temp file
    assert find_cached(cfg.filename, tmp_path) is None
    assert [p for p in list_artifacts(tmp_path) if p.parent == tmp_path] == []
