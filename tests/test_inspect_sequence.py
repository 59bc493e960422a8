"""``inspect`` on a sequence artifact: the terminal row with query and target, and the band figure
whose bright column sits at each head's offset."""

import json

import numpy as np
import pytest
from conftest import error_line

from structinit.analysis.figures import band_figure
from structinit.analysis.quality import artifact_attention
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve


@pytest.fixture
def seq_artifact(cache_dir):
    return solve(SolveConfig(grid=(30,), dim=32, heads=4, filter=5, offset_order="centre",
                             params={"target_mass": 0.6})).artifact


def test_band_figure_puts_each_head_on_its_offset(seq_artifact):
    attn = artifact_attention(seq_artifact, 0)
    fig = band_figure(attn, 15, seq_artifact.offsets[0], "title")
    bands = [ax for ax in fig.axes if ax.get_xlabel() == "relative position (key - query)"]
    assert len(bands) == 4
    assert [ax.images[0].colorbar is not None for ax in bands].count(True) == 1  # one colour bar for them
    for head, ax in enumerate(bands):
        band = np.asarray(ax.images[0].get_array())  # [queries, relative positions], blank (nan) outside
        reach = (band.shape[1] - 1) // 2
        column = int(np.nanargmax(np.nanmean(band, axis=0))) - reach
        assert column == int(seq_artifact.offsets[0, head, 1])
        assert ax.images[0].get_clim() == bands[0].images[0].get_clim()  # one scale for every band
        assert np.isnan(band[0, :reach]).all()  # keys before the first token are outside the sequence


@pytest.mark.slow  # over 10 s on one core: a full training or Hugging Face round trip, or many CLI calls
def test_inspect_sequence_artifact_cli(seq_artifact, cli, tmp_path):
    png = tmp_path / "band.png"
    r = cli("inspect", seq_artifact.key, "--head", "1", "--query", "10", "--png", png)
    assert r.returncode == 0, r.stderr
    dx = int(seq_artifact.offsets[0, 1, 1])
    assert f"query position 10, offset dx={dx:+d} -> target position {10 + dx}" in r.stdout
    row = [line for line in r.stdout.splitlines() if "Q" in line and "T" in line][0]
    assert row.index("T") - row.index("Q") == 2 * dx  # two characters a position
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000
    again = cli("inspect", seq_artifact.key, "--png", png)
    assert again.returncode == 2 and "already exists" in again.stderr
    js = json.loads(cli("inspect", seq_artifact.key, "--json").stdout)
    assert js["config"]["grid"] == [30] and "causal" not in js["config"]


def test_solve_cli_sequences_and_refusals(cli, cache_dir):
    r = cli("solve", "--grid", "30", "--dim", "32", "--heads", "4", "--filter", "3", "--causal", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["config"]["causal"] is True and all(dx <= 0 and dy == 0 for dy, dx in out["offsets"][0])
    assert out["path"].split("/")[-1].startswith("s30-d32-h4-f3-")
    before = sorted(p.name for p in cache_dir.glob("*.safetensors"))
    for args, message in [
        (("--grid", "8x8", "--dim", "32", "--heads", "4", "--causal"), "--causal applies to sequences"),
        (("--grid", "30", "--dim", "32", "--heads", "4", "--filter", "31"), "--filter 31 is longer than the sequence"),
        (("--tokens", "36", "--grid", "36", "--dim", "32", "--heads", "4"), "--tokens gives a square image grid"),
        (("--grid", "30", "--dim", "32", "--heads", "4", "--causal", "--padding", "circular"), "needs zero padding"),
    ]:
        bad = cli("solve", *args)
        assert bad.returncode == 2 and message in error_line(bad.stderr), bad.stderr
    assert sorted(p.name for p in cache_dir.glob("*.safetensors")) == before
