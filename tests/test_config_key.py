import dataclasses
import subprocess
import sys

import pytest

from structinit.errors import UsageError
from structinit.solver.config import SolveConfig

BASE = SolveConfig(grid=(16, 16), dim=192, heads=3, filter=3)


@pytest.mark.slow
def test_key_is_stable_across_processes_and_hash_seeds():
    code = ("from structinit.solver.config import SolveConfig;"
            "print(SolveConfig(grid=(16, 16), dim=192, heads=3, filter=3).key)")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": ""}).stdout.strip() for s in (1, 2)}
    assert keys == {BASE.key}
    assert len(BASE.key) == 12
    assert BASE.filename == f"n256-d192-h3-f3-{BASE.key}.safetensors"
    assert SolveConfig(grid=(8, 12), dim=64, heads=4).filename.startswith("g8x12-d64-h4-f3-")


@pytest.mark.parametrize("change", [
    {"grid": (8, 32)}, {"dim": 96}, {"heads": 6}, {"filter": 5}, {"layers": 2}, {"share": True},
    {"recipe": "paper", "params": {}}, {"params": {"target_mass": 0.5}}, {"params": {"ridge": 1e-4}},
    {"pseudo_input": "pe+gaussian"}, {"pseudo_input_rest": "uniform"}, {"padding": "circular"},
    {"offset_order": "centre"}, {"seed": 1},
])
def test_every_result_changing_setting_changes_the_key(change):
    assert dataclasses.replace(BASE, **change).key != BASE.key


def test_key_ignores_defaults_spelled_out_and_round_trips():
    assert SolveConfig(grid=(16, 16), dim=192, heads=3, params={"target_mass": 0.3}).key == BASE.key
    assert SolveConfig(grid=(16, 16), dim=192, heads=3, pseudo_input_rest="pe").key == BASE.key
    assert SolveConfig.from_dict(BASE.to_dict()) == BASE


def test_device_and_cache_path_are_not_in_the_key(tmp_path):
    from structinit.solver.run import solve

    a = solve(BASE, cache_dir=tmp_path / "a", device="cpu").artifact
    b = solve(BASE, cache_dir=tmp_path / "b", device="auto").artifact
    assert a.key == b.key == BASE.key and a.path.name == b.path.name
    assert "device" not in BASE.canonical_json() and "cache" not in BASE.canonical_json()


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=190, heads=5), "divisible by 4"),
    (dict(dim=192, heads=5), "dim 192 is not divisible by heads 5"),
    (dict(dim=192, heads=3, filter=17), "larger than"),
    (dict(dim=192, heads=3, filter=0), "positive"),
    (dict(dim=192, heads=3, layers=0), "positive"),
    (dict(dim=-4, heads=1), "positive"),
])
def test_impossible_shapes(kwargs, message):
    with pytest.raises(UsageError, match=message):
        SolveConfig(grid=(16, 16), **kwargs)
