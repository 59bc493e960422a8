"""bench report --attention's per-layer fidelity: the table and the figure show each method's own
measures, layer by layer; methods without solved offsets have no hit rate, only the window share."""

import numpy as np
import pytest

from structinit.errors import UsageError
from structinit.experiments.attention import fidelity_markdown, fidelity_rows, grid_attention, grid_fidelity_figure
from structinit.experiments.expand import expand
from structinit.experiments.gridspec import parse_grid_text

GRID = """\
name = "fid"
title = "Fidelity grid"
seeds = 1
rows = "init"
columns = ["train_size"]
[settings]
model = "vit-digits"
dataset = "digits"
depth = 2
dim = 32
val_size = 100
[[axes.init]]
id = "mimetic"
init = "mimetic"
[[axes.init]]
id = "imp"
label = "Impulse"
init = "impulse"
init_params = { data_fit = 0 }
[[axes.init]]
id = "cnn"
model = "convmixer-256"
dim = 32
depth = 1
[[axes.train_size]]
id = "100"
train_size = 100
"""


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    ex = expand(parse_grid_text(GRID, "fid.toml", "fid"), runs_dir=tmp_path_factory.mktemp("runs"))
    return grid_attention(ex, images=12)


def test_rows_are_each_methods_own_per_layer_measures(entries, one_torch_thread):
    assert [e.row for e in entries] == ["mimetic", "imp", "cnn"] and entries[2].fidelity is None
    rows = fidelity_rows(entries)
    assert [(r["row"], r["layer"]) for r in rows] == [("mimetic", 1), ("mimetic", 2), ("imp", 1), ("imp", 2)]
    imp = entries[1].fidelity
    for r in rows[2:]:
        l = r["layer"] - 1
        assert r["hit_rate"] == pytest.approx(float(np.nanmean(imp.hit_rate[l])))
        assert r["window_mass"] == pytest.approx(float(imp.window_mass[l].mean()))
    assert rows[0]["hit_rate"] is None and rows[0]["window_mass"] == pytest.approx(
        float(entries[0].fidelity.window_mass[0].mean()))
    text = fidelity_markdown(entries)
    line = next(x for x in text.splitlines() if x.startswith("| Impulse |"))
    assert line == "| Impulse | " + " | ".join(f"{r['hit_rate']:.2f} / {r['window_mass']:.2f}" for r in rows[2:]) + " |"
    assert next(x for x in text.splitlines() if x.startswith("| mimetic |")).count("- / ") == 2
    assert "On 12 real training images" in text and "cnn" not in text


def test_figure_has_a_hit_rate_line_per_impulse_method_and_a_window_line_per_method(entries):
    fig = grid_fidelity_figure(entries, title="t")
    hit, win = fig.axes[:2]
    assert [ln.get_label() for ln in hit.lines] == ["Impulse"]
    assert [ln.get_label() for ln in win.lines] == ["mimetic", "Impulse"]
    rows = fidelity_rows(entries)
    assert list(hit.lines[0].get_ydata()) == pytest.approx([r["hit_rate"] for r in rows[2:]])
    assert list(win.lines[0].get_xdata()) == [1, 2]
    assert hit.get_xlabel() == "layer" and "hit rate" in hit.get_ylabel() and fig._suptitle.get_text().startswith("t")
    with pytest.raises(UsageError, match="no init method of this grid has a model with attention"):
        grid_fidelity_figure(entries[2:])
