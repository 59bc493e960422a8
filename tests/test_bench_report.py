"""bench report: the numbers of real finished runs aggregated by hand and compared with the tables,
CSV and JSON; unfinished cells marked; the paper's numbers beside ours; figures; the report folder
written all or nothing."""

import csv
import dataclasses
import io
import json
import math
import statistics

import pytest
from grids import MIMETIC_KAIMING, TINY_GRID, expand_text, train_grid, variant

from structinit.errors import UsageError
from structinit.experiments.expand import expand
from structinit.experiments.output import render_report, write_report
from structinit.experiments.report import collect, markdown, reports_for_folder

SIZES = """\
[[axes.train_size]]
id = "200"
train_size = 200
[[axes.train_size]]
id = "all"
label = "all (1337)"
"""
GRID = variant(TINY_GRID, name="mini", title="Mini digits grid", columns=["train_size"], baseline="mimetic",
               val_size=100, axes=MIMETIC_KAIMING + SIZES, append="""\
[paper]
source = "a made-up table"
values.mimetic = [70.0, 90.0]
values.kaiming = [65.5, nan]
""")


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
    """The mini grid with every run finished but Kaiming / all / seed 1 (left pending)."""
    runs = tmp_path_factory.mktemp("report") / "runs"
    ex = expand_text(GRID, runs, command="structinit bench grid mini.toml")
    return train_grid(ex, skip=lambda cell: (cell.row, cell.column, cell.seed) == ("kaiming", ("all",), 1))


def finals(ex, row, col):
    out = {}
    for c in ex.cells:
        if c.row == row and c.column == (col,):
            path = ex.run_dir(c) / "final.json"
            if path.exists():
                out[c.seed] = json.loads(path.read_text())["final_acc"]
    return out


@pytest.mark.slow
def test_cells_aggregate_the_runs_final_accuracies(grid_runs):
    ex = grid_runs
    rep = collect(ex)
    for row in ("mimetic", "kaiming"):
        for col in ("200", "all"):
            want = finals(ex, row, col)
            c = rep.cells[(row, (col,))]
            assert c.final == want and c.n == len(want) and c.expected == 2
            assert c.final_mean == pytest.approx(statistics.mean(want.values()))
            if len(want) > 1:
                assert c.final_std == pytest.approx(statistics.stdev(want.values()))
            else:
                assert c.final_std is None  # one seed has no spread
            vals = [r.final_val_acc for r in rep.runs
                    if r.row == row and r.column == (col,) and r.final_acc is not None]
            assert len(vals) == len(want) and all(v is not None for v in vals)
            assert c.val_mean == pytest.approx(statistics.mean(vals))
    # paired by seed against the baseline; the pending seed is left out of the pairs
    m, k = finals(ex, "mimetic", "all"), finals(ex, "kaiming", "all")
    c = rep.cells[("kaiming", ("all",))]
    assert c.n_paired == 1 and c.delta_mean == pytest.approx(k[0] - m[0]) and c.delta_se is None
    m, k = finals(ex, "mimetic", "200"), finals(ex, "kaiming", "200")
    diffs = [k[s] - m[s] for s in (0, 1)]
    c = rep.cells[("kaiming", ("200",))]
    assert c.delta_mean == pytest.approx(statistics.mean(diffs))
    assert c.delta_se == pytest.approx(statistics.stdev(diffs) / math.sqrt(2))
    assert c.paper == 65.5 and c.paper_delta == pytest.approx(-4.5)
    assert rep.cells[("kaiming", ("all",))].paper is None  # nan in the file: no number
    assert rep.counts() == {"finished": 7, "pending": 1} and rep.problems() == []
    assert {r.train_images for r in rep.runs if r.column == ("200",)} == {200}
    assert rep.learning_curve_axis() == "train_size"


@pytest.mark.slow
def test_markdown_marks_unfinished_cells_and_shows_the_paper(grid_runs):
    rep = collect(grid_runs)
    text = markdown(rep)
    c = rep.cells[("kaiming", ("all",))]
    assert f"| Kaiming | {rep.cells[('kaiming', ('200',))].final_mean:.2f} ± " in text
    final = text.split("### Final-epoch test accuracy")[1].split("###")[0]
    assert f"| {c.final_mean:.2f} (1/2) |" in final and "± 0.00" not in text  # one of two seeds: marked, no ±
    assert "[65.50]" in text and "[70.00]" in text and "[-4.50]" in text
    assert "### Difference to Mimetic (percentage points)" in text and "(1)" in text
    assert "the validation split" in text and "structinit bench grid mini.toml" in text
    assert "7 finished, 1 pending" in text
    m = rep.cells[("mimetic", ("200",))]
    assert "### Final-epoch validation accuracy (%)" in text
    assert f"| Mimetic | {m.val_mean:.2f} ± {m.val_std:.2f} |" in text


@pytest.mark.slow
def test_csv_json_and_the_folder_form_agree(grid_runs, tmp_path):
    ex = grid_runs
    reps = reports_for_folder(ex.runs_dir)
    assert len(reps) == 1 and reps[0].spec.name == "mini"
    files = render_report(reps, figures=True)
    assert set(files) == {"report.md", "cells.csv", "runs.csv", "report.json", "mini-accuracy.png",
                          "mini-learning-curve.png", "mini-curves.png"}
    rows = list(csv.DictReader(io.StringIO(files["cells.csv"])))
    assert len(rows) == 4
    by = {(r["row_id"], r["column_id"]): r for r in rows}
    assert float(by[("kaiming", "200")]["paper_delta"]) == pytest.approx(-4.5)
    assert int(by[("kaiming", "all")]["n"]) == 1 and by[("kaiming", "all")]["paper"] == ""
    from structinit.experiments.plots import _subtitle

    assert _subtitle(collect(ex)) == "mini: final-epoch test accuracy, 1-2 of 2 seeds per cell"  # one run pending
    c = collect(ex).cells[("kaiming", ("200",))]
    assert float(by[("kaiming", "200")]["val_mean"]) == pytest.approx(c.val_mean, abs=1e-4)
    runs = list(csv.DictReader(io.StringIO(files["runs.csv"])))
    assert len(runs) == 8 and sum(r["state"] == "pending" for r in runs) == 1
    doc = json.loads(files["report.json"])["grids"][0]
    assert doc["counts"] == {"finished": 7, "pending": 1} and len(doc["cells"]) == 4
    written = write_report(files, tmp_path / "rep")
    assert sorted(p.name for p in written) == sorted(files)
    png = (tmp_path / "rep" / "mini-learning-curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with pytest.raises(UsageError, match="already holds .*report.md.*force"):
        write_report(files, tmp_path / "rep")
    before = (tmp_path / "rep" / "report.md").read_text()
    files2 = dict(files, **{"report.md": "new"})
    files2["broken.png"] = object()  # cannot be drawn: nothing of the new report may land
    with pytest.raises(AttributeError):  # an object() is no matplotlib figure
        write_report(files2, tmp_path / "rep", force=True)
    assert (tmp_path / "rep" / "report.md").read_text() == before
    assert not (tmp_path / "rep" / "broken.png").exists()
    assert not [p for p in (tmp_path / "rep").iterdir() if p.name.startswith(".report-")]


@pytest.mark.slow
def test_the_cli_report_prints_writes_and_refuses(grid_runs, tmp_path, cli):
    runs = grid_runs.runs_dir
    r = cli("bench", "report", runs)
    assert r.returncode == 0 and "## Mini digits grid" in r.stdout and "(1/2)" in r.stdout
    r = cli("bench", "report", runs, "--json")
    assert json.loads(r.stdout)["grids"][0]["counts"] == {"finished": 7, "pending": 1}
    r = cli("bench", "report", runs, "--report-dir", tmp_path / "out", "--attention", "--attention-images", "16")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "mini-attention.png").stat().st_size > 10_000
    att = json.loads((tmp_path / "out" / "report.json").read_text())["attention"]["mini"]
    assert [e["label"] for e in att] == ["Mimetic", "Kaiming"] and att[0]["fidelity"]["images"] == 16
    r = cli("bench", "report", runs, "--report-dir", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("error: --report-dir") and "--force" in r.stderr
    r = cli("bench", "report", runs, "--report-dir", tmp_path / "out", "--force", "--no-figures", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["grids"][0]["counts"]["finished"] == 7  # stdout stays JSON
    assert not (tmp_path / "out" / "mini-attention.png").exists()
    assert ("removed 5 files of the earlier report that this one does not write: mini-accuracy.png, "
            "mini-attention.png, mini-curves.png, mini-fidelity.png, mini-learning-curve.png") in r.stderr
    assert "--attention draws the attention figure again" in r.stderr
    r = cli("bench", "report", runs, "--grid", "nope")
    assert r.returncode == 2 and "no grid 'nope' in this folder" in r.stderr
    (tmp_path / "grid.toml").write_text(GRID)
    r = cli("bench", "report", tmp_path / "grid.toml", "--out", runs, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["grids"][0]["counts"]["finished"] == 7
    r = cli("bench", "report", tmp_path / "grid.toml", "--out", runs, "--seeds", "3")
    assert r.returncode == 0 and "(2/3)" in r.stdout  # seed 2 was never run: every cell is short of it


@pytest.mark.slow  # reads the module's seven trained runs, as the other report tests do
def test_an_earlier_runs_csv_stands_in_for_run_folders_that_are_gone(grid_runs, tmp_path):
    """A report's runs.csv gives back, by run key, the runs whose folders were removed: the cells
    and paired differences equal those of the folders themselves; keys not in the grid are ignored."""
    from structinit.experiments.report import read_runs_csv, runs_csv

    ex = grid_runs
    full = collect(ex)
    table = tmp_path / "runs.csv"
    table.write_text(runs_csv([full]) + "mini,0123456789ab,mimetic,200,9,finished,1.0,,,,,,,,\n")
    earlier = read_runs_csv(table)
    assert len(earlier) == 8  # 7 finished runs of the grid and one of another expansion; the pending run left out
    mimetic_200 = [c for c in ex.cells if c.row == "mimetic" and c.column == ("200",)]
    assert earlier[mimetic_200[0].key].final_acc == pytest.approx(full.runs[ex.cells.index(mimetic_200[0])].final_acc,
                                                                  abs=1e-4)
    empty = expand(ex.spec, runs_dir=tmp_path / "gone")  # the same runs, no folders
    rebuilt = collect(empty, earlier)
    assert [r.state for r in rebuilt.runs] == [r.state for r in full.runs]
    for key, cell in full.cells.items():
        got = rebuilt.cells[key]
        assert got.n == cell.n and got.final == pytest.approx(cell.final, abs=1e-4)
        if cell.delta_mean is not None:
            assert got.delta_mean == pytest.approx(cell.delta_mean, abs=1e-4)
    assert collect(empty).cells[("mimetic", ("200",))].n == 0  # without it, nothing
    # the report says which runs came from the table, and that the table is needed to make it again
    assert {r.source for r in rebuilt.runs} == {str(table), None}  # the pending run has no source
    assert [r.source for r in collect(ex, earlier).runs] == [None] * len(ex.cells)  # the folders' own runs
    text = markdown(rebuilt)
    assert f"7 of the finished runs are read from `{table}`" in text and f"`--runs-csv {table}`" in text
    assert "read from" not in markdown(full)
    # where the runs trained is read from their folders, kept in the CSV and said in the report
    assert {r.device for r in full.runs if r.state == "finished"} == {"cpu"}
    assert {r.device for r in earlier.values()} == {"cpu", None}  # the line added above has no device
    assert "Trained on: cpu (7 runs)." in markdown(full) and "pooled" not in markdown(full)
    first = mimetic_200[0].key
    moved = collect(empty, {**earlier, first: dataclasses.replace(earlier[first], device="cuda:1")})
    text = markdown(moved)
    assert "Trained on: cpu (6 runs), cuda (1 run)." in text
    assert "pooled in 1 of the cells (Mimetic / 200)" in text
    # a folder's own finished run wins over the table
    changed = {k: dataclasses.replace(v, final_acc=0.0) for k, v in earlier.items()}
    assert collect(ex, changed).cells[("mimetic", ("200",))].final == full.cells[("mimetic", ("200",))].final
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match=r"runs_csv .*bad.csv is not the runs.csv of a report"):
        read_runs_csv(tmp_path / "bad.csv")
    with pytest.raises(UsageError, match=r"runs_csv .*nothing.csv: No such file"):
        read_runs_csv(tmp_path / "nothing.csv")


@pytest.mark.slow  # three CLI processes
def test_report_cli_baseline_and_runs_csv(grid_runs, tmp_path, cli):
    from structinit.experiments.report import runs_csv

    (tmp_path / "grid.toml").write_text(GRID)
    table = tmp_path / "runs.csv"
    table.write_text(runs_csv([collect(grid_runs)]))
    r = cli("bench", "report", tmp_path / "grid.toml", "--out", tmp_path / "gone", "--runs-csv", table,
            "--baseline", "kaiming", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["grids"][0]
    assert doc["baseline"] == "kaiming" and doc["counts"] == {"finished": 7, "pending": 1}
    cells = {(c["row"], tuple(c["column"])): c for c in doc["cells"]}
    want = collect(grid_runs).cells
    pairs = [want[("mimetic", ("200",))].final[s] - want[("kaiming", ("200",))].final[s] for s in (0, 1)]
    assert cells[("mimetic", ("200",))]["delta_mean"] == pytest.approx(statistics.mean(pairs), abs=1e-3)
    r = cli("bench", "report", tmp_path / "grid.toml", "--out", tmp_path / "gone", "--baseline", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: --baseline 'nope' is not a row of mini")
    r = cli("bench", "report", grid_runs.runs_dir, "--runs-csv", table)
    assert r.returncode == 2 and "--runs-csv" in r.stderr and "apply to a grid" in r.stderr


def test_learning_curve_lines_break_where_a_size_has_no_runs():
    from structinit.experiments.plots import gapped_line

    def shown(values):
        return [None if math.isnan(v) else v for v in values]

    xs, means, stds = gapped_line([None, (500, 72.0, 0.5), None, None, (5000, 74.0, 0.3), None,
                                   (55000, 80.0, 0.2), None])
    # one break between 500 and 5,000 (not two), one between 5,000 and all; missing ends dropped
    assert shown(xs) == [500, None, 5000, None, 55000]
    assert shown(means) == [72.0, None, 74.0, None, 80.0]
    assert shown(stds) == [0.5, None, 0.3, None, 0.2]
    assert gapped_line([(1, 2.0, 0.0), (2, 3.0, 1.0)]) == ([1, 2], [2.0, 3.0], [0.0, 1.0])
    assert gapped_line([None, None]) == ([], [], [])


@pytest.mark.slow
def test_the_learning_curve_figure_leaves_a_gap_for_a_missing_size(tmp_path):
    """A real grid of three sizes whose middle size was never run: the line has no segment across it."""
    from structinit.experiments.plots import learning_curve_figure

    text = variant(GRID, seeds=1, axes="""\
[[axes.init]]
id = "mimetic"
label = "Mimetic"
init = "mimetic"
[[axes.train_size]]
id = "100"
train_size = 100
[[axes.train_size]]
id = "200"
train_size = 200
[[axes.train_size]]
id = "400"
train_size = 400
""")
    ex = expand_text(text, tmp_path / "runs", file="gap.toml", command="test")
    rep = collect(train_grid(ex, skip=lambda cell: cell.column == ("200",)))
    (line,) = [ln for ln in learning_curve_figure(rep).axes[0].get_lines() if ln.get_linestyle() == "-"]  # not the caps
    xs = [float(x) for x in line.get_xdata()]
    assert xs[0] == 100 and math.isnan(xs[1]) and xs[2] == 400
    ys = [float(y) for y in line.get_ydata()]
    assert ys[0] == pytest.approx(rep.cells[("mimetic", ("100",))].final_mean) and math.isnan(ys[1])


SAME_BASE = """\
name = "bases"
seeds = 3
rows = "init"
columns = ["train_size"]
baseline = "mimetic"
[settings]
model = "vit-digits"
dataset = "digits"
epochs = 2
[[axes.init]]
id = "mimetic"
init = "mimetic"
init_params = { base = "model" }
[[axes.init]]
id = "impulse"
init = "impulse"
init_params = { base = "model" }
[[axes.init]]
id = "mimetic-mlp"
init = "mimetic"
init_params = { base = "pytorch-mlp" }
[[axes.init]]
id = "impulse-mlp"
init = "impulse"
init_params = { base = "pytorch-mlp" }
[[axes.init]]
id = "authors"
init = "impulse-2024"
[[axes.train_size]]
id = "100"
train_size = 100
"""


def test_every_init_is_paired_with_the_baseline_on_its_own_base(tmp_path):
    """impulse on the MLP base is paired with mimetic on the MLP base, never with mimetic on the
    model's base (4.5 points of base); the authors' recipe (PyTorch's base everywhere) has no
    mimetic on its base in this grid, so it gets no difference rather than one across bases; and
    the init shown at its own best base is the base chosen on validation."""
    from structinit.experiments.gridspec import parse_grid_text
    from structinit.experiments.report import markdown, read_runs_csv

    ex = expand(parse_grid_text(SAME_BASE, "bases.toml"), runs_dir=tmp_path / "runs")
    finals = {"mimetic": (70, 71, 72), "impulse": (71, 72, 73), "mimetic-mlp": (75, 75, 75),
              "impulse-mlp": (75.5, 75.5, 76.5), "authors": (60, 61, 62)}
    vals = {"mimetic": 80, "impulse": 81, "mimetic-mlp": 79, "impulse-mlp": 82, "authors": 50}
    lines = ["grid,key,row_id,column_id,seed,state,final_acc,best_acc,best_epoch,best_on,final_val_acc,epochs,"
             "train_images,wall_seconds,problem,algorithms,device"]
    for c in ex.cells:
        lines.append(f"bases,{c.key},{c.row},100,{c.seed},finished,{finals[c.row][c.seed]},,,,{vals[c.row]},2,100,1,,,")
    (tmp_path / "runs.csv").write_text("\n".join(lines) + "\n")
    rep = collect(ex, earlier=read_runs_csv(tmp_path / "runs.csv"), mixed_versions=True)
    cell = {r: rep.cells[(r, ("100",))] for r in finals}
    assert cell["impulse"].paired_with == "mimetic" and cell["impulse"].delta_mean == pytest.approx(1.0)
    assert cell["impulse-mlp"].paired_with == "mimetic-mlp"
    assert cell["impulse-mlp"].delta_mean == pytest.approx(0.8333333, abs=1e-6)  # not +4.5 across bases
    assert cell["impulse-mlp"].base == "pytorch-mlp" and cell["authors"].base == "pytorch"
    assert cell["authors"].delta_mean is None and cell["authors"].paired_with is None
    assert cell["mimetic-mlp"].delta_mean is None  # the baseline of its base
    text = markdown(rep)
    assert "Difference to mimetic on the same base (percentage points)" in text
    assert "| impulse-mlp [pytorch-mlp] vs mimetic-mlp | +0.83 ± 0.33 (3) |" in text
    differences = text.split("Difference")[1].split("Each init")[0]
    assert "| authors [pytorch] | — |" in differences and "| mimetic-mlp [pytorch-mlp]" not in differences
    own = text.split("Each init at its own best base")[1]
    assert "| mimetic (bases: model, pytorch-mlp) | 71.00 ± 1.00 [model] |" in own  # val 80 beats 79
    assert "| impulse (bases: model, pytorch-mlp) | 75.83 ± 0.58 [pytorch-mlp] |" in own  # val 82 beats 81
    # The figures name each row's base as the tables do: the authors' recipe is drawn as what it is.
    from structinit.experiments.plots import accuracy_figure

    ticks = [t.get_text().replace("\n", " ") for t in accuracy_figure(rep).axes[0].get_yticklabels()]
    assert "authors [pytorch]" in ticks and "impulse-mlp [pytorch-mlp]" in ticks and "mimetic [model]" in ticks


@pytest.mark.slow  # reads the module's seven trained runs, as the other report tests do
def test_runs_from_two_installs_are_flagged_and_a_rerun_that_differs_names_the_versions(grid_runs, tmp_path, cli):
    """One run's final.json edited to say it ran under another torch (as a run made on another
    install says): the report names the field and both values with their run counts, in markdown
    and JSON; a runs.csv keeps the versions and gives them back, and one made before it had the
    column still loads. A rerun whose number differs from the runs.csv's names what differs."""
    import platform
    import shutil

    import torch

    from structinit.experiments.report import read_runs_csv, runs_csv

    runs = tmp_path / "runs"
    shutil.copytree(grid_runs.runs_dir, runs)
    ex = expand(grid_runs.spec, runs_dir=runs)
    assert "different versions" not in markdown(collect(ex))  # one install: nothing to flag
    moved = next(c for c in ex.cells if (c.row, c.column, c.seed) == ("mimetic", ("200",), 0))
    final_path = ex.run_dir(moved) / "final.json"
    final = json.loads(final_path.read_text())
    assert final["versions"]["python"] == platform.python_version()
    final_path.write_text(json.dumps(dict(final, versions=dict(final["versions"], torch="1.13.1"))))
    here = torch.__version__
    rep = collect(ex)
    want = f"Ran under different versions: torch 1.13.1 (1 run), {here} (6 runs)."
    assert want in markdown(rep) and rep.to_dict()["versions_differ"] == {"torch": {"1.13.1": 1, here: 6}}
    r = cli("bench", "report", runs)
    assert r.returncode == 0 and want in r.stdout, r.stderr
    # runs.csv keeps what each run ran under; a runs.csv of before (no versions column) still loads
    table = tmp_path / "runs.csv"
    table.write_text(runs_csv([collect(grid_runs)]))
    earlier = read_runs_csv(table)
    assert earlier[moved.key].versions["torch"] == here and earlier[moved.key].versions["python"] == \
        platform.python_version()
    old = tmp_path / "old.csv"
    old.write_text("\n".join(line.rsplit(",", 1)[0] for line in table.read_text().splitlines()) + "\n")
    assert "versions" not in old.read_text().splitlines()[0] and read_runs_csv(old)[moved.key].versions is None
    # the same key with another number: the rerun says which versions differ, or that none were recorded
    acc = final["final_acc"]
    lines = table.read_text().splitlines()
    table.write_text("\n".join(line.replace(f",{acc:.4f},", f",{acc - 1:.4f},", 1) if moved.key in line else line
                               for line in lines) + "\n")
    rep = collect(ex, read_runs_csv(table))
    assert [(d["key"], d["final_acc"], d["earlier_acc"]) for d in rep.reruns] == [(moved.key, acc, round(acc - 1, 4))]
    assert rep.reruns[0]["why"] == f"versions differ: torch 1.13.1 here, {here} there"
    assert (f"Rerun {moved.key} (Mimetic / 200, seed 0): final {acc:.4f} here, {acc - 1:.4f} in `{table}`; "
            f"versions differ: torch 1.13.1 here, {here} there.") in markdown(rep)
    old.write_text("\n".join(line.rsplit(",", 1)[0] for line in table.read_text().splitlines()) + "\n")
    assert collect(ex, read_runs_csv(old)).reruns[0]["why"] == \
        "the runs.csv recorded no versions, so what changed is not known"
    (tmp_path / "grid.toml").write_text(GRID)
    r = cli("bench", "report", tmp_path / "grid.toml", "--out", runs, "--runs-csv", table, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["grids"][0]["reruns"][0]["key"] == moved.key, r.stderr
