"""The CLI end to end: solve, cache hit, inspect, bench solver, bad input (the first test through the real
entry point in a subprocess, the others in-process)."""

import json

import pytest
from conftest import error_line

from structinit.solver.artifact import read_artifact


@pytest.mark.slow
def test_solve_then_cache_hit_then_inspect(cli_process, cache_dir, tmp_path):
    cli = cli_process  # the real console entry point, in a subprocess
    args = ["solve", "--tokens", "64", "--dim", "64", "--heads", "4", "--filter", "3", "--layers", "2"]
    first = cli(*args, "--json")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["cached"] is False and doc["path"].startswith(str(cache_dir))
    assert doc["stats"]["summary"]["hit_rate"] == 1.0
    second = cli(*args)
    assert second.returncode == 0 and "cache hit" in second.stdout and doc["key"] in second.stdout
    assert "(1,1)" in second.stdout or "(0,0)" in second.stdout or "offset" in second.stdout
    listing = cli("inspect", "--json")
    listed = json.loads(listing.stdout)["artifacts"]
    assert [a["key"] for a in listed if a["path"].startswith(str(cache_dir))] == [doc["key"]]
    png = tmp_path / "attn.png"
    shown = cli("inspect", doc["key"], "--layer", "1", "--head", "2", "--query", "27", "--png", png)
    assert shown.returncode == 0, shown.stderr
    assert "query token 27 (y=3, x=3)" in shown.stdout and "Q" in shown.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 500
    assert read_artifact(doc["path"]).key == doc["key"]


def test_help_has_examples(cli):
    for cmd in (["solve"], ["inspect"], ["bench", "solver"]):
        out = cli(*cmd, "--help")
        assert out.returncode == 0 and "Example" in out.stdout and "structinit " + cmd[0] in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--tokens", "250"], "not a perfect square"),
    (["--dim", "190", "--heads", "5"], "divisible by 4"),
    (["--dim", "192", "--heads", "5"], "--dim 192 is not divisible by --heads 5"),
    (["--tokens", "16", "--filter", "5"], "larger than the 4x4 grid"),
    (["--filter", "0"], "positive"),
    (["--layers", "-1"], "positive"),
    (["--recipe", "magic"], "unknown --recipe"),
    (["--device", "tpu"], "unknown --device"),
    (["--device", "cuda"], "no CUDA GPU"),
    (["--grid", "16by16"], "HxW"),
    (["--target-mass", "1.2"], "target"),
    (["--recipe", "paper", "--target-mass", "0.5"], "no parameter"),
    (["--pseudo-input", "noise"], "unknown --pseudo-input"),
])
def test_bad_input_is_one_line_and_exit_2(cli, args, message, cache_dir):
    out = cli("solve", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in error_line(out.stderr) and not list(cache_dir.glob("*.safetensors"))


def test_inspect_bad_targets(cli, tmp_path):
    missing = cli("inspect", "no-such-key")
    assert missing.returncode == 2 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr
    broken = tmp_path / "n16-d16-h2-f3-0123456789ab.safetensors"
    broken.write_bytes(b"\x00" * 40)
    out = cli("inspect", broken)
    assert out.returncode != 0 and "error:" in out.stderr and "Traceback" not in out.stderr


def test_bench_solver_json(cli):
    out = cli("bench", "solver", "--tokens", "36", "--dim", "32", "--heads", "4",
              "--recipes", "paper,closed-form,fast", "--iters", "300", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {r["recipe"]: r for r in doc["rows"]}
    assert set(rows) == {"paper", "closed-form", "fast"}
    # fast was asked for the mass paper reached, and reached it
    assert rows["fast"]["params"]["target_mass"] == pytest.approx(rows["paper"]["target_mass"])
    assert rows["fast"]["target_mass"] == pytest.approx(rows["paper"]["target_mass"], abs=0.02)
    assert rows["fast"]["hit_rate"] >= rows["paper"]["hit_rate"]
    assert rows["fast"]["speedup_vs_paper"] > 1
