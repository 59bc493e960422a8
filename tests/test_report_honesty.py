"""Reports that cannot mislead: one seed is shown as one seed (no "± 0.00"), a cell whose runs all
failed says so, the best epoch names the split it was chosen on even before anything finished, two
expansions of one grid in one folder are reported under names of their own, and a forced report
replaces an earlier one whole. Real training runs (a run that fails, fails in train itself)."""

import csv
import io
import json

import pytest
from grids import DIGITS, MIMETIC_KAIMING, TINY_GRID, expand_text, trained_grid, variant

from structinit.experiments.launch import prepare_runs
from structinit.experiments.report import collect, markdown, reports_for_folder

GRID = variant(TINY_GRID, name="h", title="Honest grid", columns=["size"], epochs=1, axes=MIMETIC_KAIMING + """\
[[axes.size]]
id = "64"
train_size = 64
[[axes.size]]
id = "big-batch"
label = "64, batch 128"
train_size = 64
batch_size = 128
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The grid with Mimetic / 64 finished on both seeds, Kaiming / 64 on seed 0 only, and every
    run of the big-batch column failed (a batch larger than the training set: train refuses it)."""
    root = tmp_path_factory.mktemp("honest")
    ex = trained_grid(root, GRID, file="h.toml",
                      skip=lambda cell: (cell.row, cell.seed, cell.column) == ("kaiming", 1, ("64",)),
                      state=lambda cell: "failed" if cell.column == ("big-batch",) else "finished")
    return root, ex


def test_one_seed_is_shown_as_one_and_failed_cells_as_failed(runs):
    root, ex = runs
    rep = collect(ex)
    text = markdown(rep)
    one = rep.cells[("kaiming", ("64",))]
    assert one.n == 1 and one.final_std is None
    assert f"| {one.final_mean:.2f} (1/2) |" in text and "± 0.00" not in text  # S12
    assert "| failed (0/2) |\n" in text.split("### Final-epoch test accuracy")[1].split("###")[0]  # S13
    assert "pending (0/2)" not in text
    row = next(line for line in csv.DictReader(io.StringIO(_cells_csv(rep))) if line["row_id"] == "kaiming"
               and line["column_id"] == "64")
    assert row["final_std"] == "" and row["n"] == "1"  # the CSV says the same: no spread of one value


def _cells_csv(rep):
    from structinit.experiments.report import cells_csv

    return cells_csv([rep])


def test_the_best_epoch_names_the_split_before_anything_finished(tmp_path):
    for val, says in ((0, "the test split itself (optimistic: no validation split)"), (100, "the validation split")):
        ex = expand_text(variant(GRID, val_size=val), tmp_path / f"runs{val}")
        prepare_runs(ex)
        md = markdown(collect(ex))
        assert "Best epoch chosen" not in md
        assert f"with the best accuracy on {says}; mean" in md, md  # S14
        # read back from the manifest alone (no configs in memory), the same
        (folder_rep,) = reports_for_folder(tmp_path / f"runs{val}")
        assert f"with the best accuracy on {says}; mean" in markdown(folder_rep)


def test_two_expansions_of_one_grid_name_are_reported_apart(runs, tmp_path, cli):  # S4
    root, _ = runs
    import shutil

    shutil.copytree(root, tmp_path / "w")
    w = tmp_path / "w"
    (w / "h.toml").write_text(variant(GRID, lr=0.02))  # the grid file edited, same name
    r = cli("bench", "grid", "h.toml", "--launcher", "print", "--only", "size=64", cwd=w)
    assert r.returncode == 0, r.stderr
    manifests = sorted(p.stem for p in (w / "runs" / "grids").glob("h-*.json"))
    assert len(manifests) == 2
    reports = reports_for_folder(w / "runs")
    assert sorted(rep.name for rep in reports) == manifests
    r = cli("bench", "report", "runs", "--report-dir", "rep", cwd=w)
    assert r.returncode == 0, r.stderr
    md = (w / "rep" / "report.md").read_text()
    titles = [line for line in md.splitlines() if line.startswith("## Honest grid")]
    assert sorted(titles) == sorted(f"## Honest grid ({m})" for m in manifests)
    pngs = sorted(p.name for p in (w / "rep").glob("*.png"))
    assert all(any(p.startswith(m + "-") for m in manifests) for p in pngs) and len(pngs) >= 2
    grids = {line["grid"] for line in csv.DictReader((w / "rep" / "cells.csv").open())}
    assert grids == set(manifests)
    lines = list(csv.DictReader((w / "rep" / "cells.csv").open()))
    keys = [(line["grid"], line["row_id"], line["column_id"]) for line in lines]
    assert len(keys) == len(set(keys))
    doc = json.loads((w / "rep" / "report.json").read_text())
    assert sorted(g["grid"] for g in doc["grids"]) == manifests and {g["grid_name"] for g in doc["grids"]} == {"h"}


def test_a_forced_report_replaces_the_earlier_one_whole(runs, tmp_path, cli):  # S24
    root, _ = runs
    import shutil

    shutil.copytree(root, tmp_path / "w")
    w = tmp_path / "w"
    (w / "other.toml").write_text(variant(GRID, name="other", seeds=1))
    assert cli("bench", "grid", "other.toml", "--only", "size=64", "--launcher", "print", cwd=w).returncode == 0
    (w / "rep").mkdir()
    (w / "rep" / "notes.txt").write_text("mine")
    r = cli("bench", "report", "runs", "--report-dir", "rep", cwd=w)
    assert r.returncode == 0, r.stderr
    first = {p.name for p in (w / "rep").iterdir()}
    assert {"h-accuracy.png", "other-accuracy.png", "notes.txt"} <= first
    r = cli("bench", "report", "runs", "--grid", "other", "--report-dir", "rep", "--force", cwd=w)
    assert r.returncode == 0, r.stderr
    now = {p.name for p in (w / "rep").iterdir()}
    assert not [n for n in now if n.startswith("h-")]  # the older grid's figures are gone with it
    assert "other-accuracy.png" in now and (w / "rep" / "notes.txt").read_text() == "mine"  # not the report's
    assert set(json.loads((w / "rep" / "report.json").read_text())["files"]) == now - {"notes.txt"}


# --------------------------------------------------------------------------- figures

def test_accuracy_panels_share_one_scale_and_the_legend_is_outside_the_data(runs):
    from structinit.experiments.plots import accuracy_figure, curves_figure, wrap

    _, ex = runs
    rep = collect(ex)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for fig, columns in ((accuracy_figure(rep), 1), (curves_figure(rep), 2)):  # big-batch: every run failed
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert len(panels) == columns
        limits = {ax.get_xlim() if ax.get_xlabel().startswith("test") else ax.get_ylim()
                  for ax in panels}
        assert len(limits) == 1  # one accuracy scale for every panel
        legends = list(fig.legends) + [ax.get_legend() for ax in panels if ax.get_legend() is not None]
        assert len(legends) == 1  # one legend for the figure, below or beside the panels, never over the data
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        box = legends[0].get_window_extent(renderer)
        for ax in panels:
            data = ax.get_window_extent(renderer)
            assert not (box.x0 < data.x1 and data.x0 < box.x1 and box.y0 < data.y1 and data.y0 < box.y1)
    label = "Impulse, the authors' 2024 released code (impulse-2024)"
    assert all(len(line) <= 26 for line in wrap(label).splitlines()) and wrap(label).replace("\n", " ") == label


SPARSE = variant(DIGITS, name="sparse", title="Sparse grid", seeds=2, columns=["size"], epochs=None, axes="""\
[[axes.init]]
id = "mimetic"
init = "mimetic"
[[axes.init]]
id = "kaiming"
init = "kaiming"
[[axes.init]]
id = "never"
label = "Never run"
init = "trunc-normal"
[[axes.size]]
id = "100"
train_size = 100
[[axes.size]]
id = "250"
train_size = 250
[[axes.size]]
id = "500"
label = "500 images, never run"
train_size = 500
""")


def test_the_accuracy_figure_draws_no_empty_panel_or_row(tmp_path):
    """A half-launched grid (stock-models drew half its panels as bare "0/10"): the methods and the
    columns without a finished seed are left out and named in the title; every panel drawn holds a
    finished seed; without any finished run there is no figure."""
    from structinit.experiments.plots import accuracy_figure
    from structinit.experiments.report import RunResult

    ex = expand_text(SPARSE, tmp_path / "runs")
    assert accuracy_figure(collect(ex)) is None  # nothing finished: no figure at all
    done = {("mimetic", ("100",), 0): 61.0, ("mimetic", ("100",), 1): 63.0, ("kaiming", ("250",), 0): 55.0}
    earlier = {c.key: RunResult(c.key, c.row, c.column, c.seed, "finished", final_acc=done[c.row, c.column, c.seed])
               for c in ex.cells if (c.row, c.column, c.seed) in done}
    fig = accuracy_figure(collect(ex, earlier))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["100", "250"]
    # No row for "never"; each row names its base (Kaiming's own, train's for mimetic).
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["kaiming [pytorch]", "mimetic [pytorch-mlp]"]
    for ax in panels:
        assert len(ax.get_yticks()) == 2  # the panels share their rows
        dots = [c for c in ax.collections if len(c.get_offsets())]
        assert dots, ax.get_title()  # a finished seed drawn in every panel
    assert len({ax.get_xlim() for ax in panels}) == 1
    left_out = "not shown, no seed finished yet: methods Never run [model]; columns 500 images, never run"
    assert left_out in fig.get_suptitle()


def test_attention_figures_have_one_colour_scale(tmp_path):
    import numpy as np

    from structinit.analysis.figures import attention_figure, band_figure
    from structinit.experiments.attention import attention_grid_figure, grid_attention

    def scales(fig):
        return {tuple(im.get_clim()) for ax in fig.axes for im in ax.get_images()}

    def colour_bars(fig):
        return [ax for ax in fig.axes if "one scale" in ax.get_ylabel()]

    n = 16
    uniform = np.full((n, n), 1.0 / n)
    peaked = np.eye(n) * 0.9 + 0.1 / n
    attn = np.stack([uniform, peaked])
    for fig in (attention_figure(attn, (4, 4), query=5), band_figure(attn, query=5)):
        assert len(scales(fig)) == 1 and len(colour_bars(fig)) == 1
    assert max(scales(attention_figure(attn, (4, 4), query=5)))[1] == pytest.approx(0.9 + 0.1 / n)

    grid = variant(GRID, columns=None, axes="""\
[[axes.init]]
id = "tn"
label = "Trunc normal, the model's own init, with a label much longer than a panel"
init = "trunc-normal"
[[axes.init]]
id = "imp"
init = "impulse"
init_params = { data_fit = 0 }
""")
    ex = expand_text(grid, tmp_path / "runs", file="a.toml")
    fig = attention_grid_figure(grid_attention(ex, images=8))
    assert len(scales(fig)) == 1 and len(colour_bars(fig)) == 1  # a uniform map is not drawn bright
    titles = [ax.get_title() for ax in fig.axes if ax.get_images()]
    assert all(max(len(line) for line in t.splitlines()) <= 40 for t in titles)
