"""The reports committed under docs/results stay reproducible: each folder's grid (its own
grid.toml, else the grid file its report's command names, else the shipped grid its runs.csv
names) expands to exactly the run keys of its
runs.csv. A key is a hash of a run's whole configuration, so a changed default, a renamed
parameter or a changed key derivation that would make the documented commands run something else
fails here."""

import csv
import json
from pathlib import Path

import pytest

from structinit.experiments.expand import expand
from structinit.experiments.gridspec import load_grid

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
FOLDERS = sorted(p.parent for p in RESULTS.rglob("runs.csv"))


def test_every_results_folder_is_checked():
    assert {p.relative_to(RESULTS).as_posix() for p in FOLDERS} >= {
        "digits", "digits-datafit", "digits-default", "mnist1d", "fashion", "fashion/pe-scale", "fashion/small",
        "fashion/ablation",
        "fashion/gpu/fashion-196", "fashion/gpu/fashion"}


def grid_of(folder: Path, name: str) -> str:
    """The folder's own grid.toml, else the grid file its report.json's command names (a report of a
    grid kept elsewhere, made with --only), else the shipped grid ``name``."""
    own = folder / "grid.toml"
    if own.exists():
        return str(own)
    report = folder / "report.json"
    if report.exists():
        for grid in json.loads(report.read_text())["grids"]:
            files = [w for w in grid["command"].split() if w.endswith(".toml")]
            if grid["grid"] == name and files:
                return str(RESULTS.parents[1] / files[0])
    return name


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_committed_runs_are_what_their_grid_expands_to(folder):
    runs = list(csv.DictReader((folder / "runs.csv").open()))
    spec = load_grid(grid_of(folder, runs[0]["grid"]))
    assert {r["grid"] for r in runs} == {spec.name}
    ex = expand(spec, seeds=max(int(r["seed"]) for r in runs) + 1)
    keys = {(c.row, "/".join(c.column), c.seed): c.key for c in ex.cells}  # as runs.csv joins the columns
    got = {(r["row_id"], r["column_id"], int(r["seed"])): r["key"] for r in runs}
    assert got.keys() <= keys.keys()
    assert {cell: keys[cell] for cell in got} == got
