"""Hostile input to the grid commands and their neighbours, as a new user gives it: options that
would change what a grid means or would do nothing are refused with one ``error:`` line (exit 2)
before anything is written; grid files whose values would collapse into the same runs, clash in
the report or be unselectable are refused at load time; reports cannot mislead; work that cannot
finish in reasonable time or memory says so before it starts."""

import os
from pathlib import Path

import pytest
from conftest import error_line
from grids import DIGITS, variant

REPO = Path(__file__).resolve().parents[1]
# three init methods, two of them impulse inits that differ in one setting, by two training-set sizes
GRID = variant(DIGITS, name="g", title="A grid", seeds=2, epochs=1, warmup_epochs=0.5, append="""\
[[axes.init]]
id = "impulse-5"
init = "impulse"
init_params = { filter = 5 }
[axes]
train_size = [100, 200]
""")


def files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def one_error(r, code, *needles):
    """One ``error:`` line on stderr, last (:func:`conftest.error_line`), nothing on stdout."""
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    line = error_line(r.stderr)
    assert r.stdout == "", r.stdout
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "g.toml").write_text(GRID)
    return tmp_path


# --------------------------------------------------------------------------- options that change meaning

@pytest.mark.parametrize("args, needles", [
    # S5, S6: --set over the setting an axis varies
    (["--set", "train_size=10"], ["--set train_size=10 would replace the axis 'train_size'", "--only train_size="]),
    (["--set", "init=impulse"], ["--set init=impulse would replace the axis 'init'", "--only init="]),
    (["--set", "init_params.filter=3"], ["values 'impulse' and 'impulse-5' of the axis 'init' the same runs"]),
    # seeds are not an axis
    (["--only", "seed=1"], ["--only: the seeds are not an axis", "--seeds"]),
])
def test_set_and_only_never_collapse_an_axis(folder, cli, args, needles):
    before = files(folder)
    one_error(cli("bench", "grid", "g.toml", *args, "--launcher", "print", cwd=folder), 2, *needles)
    assert files(folder) == before
    one_error(cli("bench", "grid", "g.toml", *args, "--status", cwd=folder), 2, *needles)


def test_set_of_a_setting_the_axis_values_also_set_is_still_allowed(folder, cli):
    # digits' sizes each set their own epochs; --set epochs=1 changes every run, the sizes stay apart
    r = cli("bench", "grid", "digits", "--set", "epochs=1", "--status", cwd=folder)
    assert r.returncode == 0 and "180 runs" in r.stdout, r.stderr


@pytest.mark.parametrize("edit, needles", [
    # S7, S8: different ids, the same settings
    (("train_size = [100, 200]", "heads = [2, 2.0]"), ["g.toml:", "the values '2' and '2.0' set the same settings"]),
    (('init_params = { filter = 5 }', 'init_params = { filter = 3 }'),  # 3 is impulse's default filter
     ["cells init=impulse, train_size=100 and init=impulse-5, train_size=100 are the same runs"]),
    # S9: one label twice
    (('id = "impulse-5"', 'id = "impulse-5"\nlabel = "impulse"'), ["the label 'impulse' twice"]),
    # S10: ids --only and the report cannot tell apart
    (('id = "impulse-5"', 'id = "impulse,5"'), ["the id 'impulse,5' has ','"]),
    (('id = "impulse-5"', 'id = "impulse/5"'), ["the id 'impulse/5' has '/'"]),
    (('id = "impulse-5"', 'id = "f=5"'), ["the id 'f=5' has '='"]),
    # S11: a string where a number goes is refused as the grid's other wrong types are
    (("train_size = [100, 200]", 'heads = [2, "4"]'), ["axis 'heads': 'heads' must be an integer, got '4'",
                                                      "without quotes"]),
    (("epochs = 1", 'epochs = "1"'), ["'epochs' must be an integer, got '1'"]),
    (("epochs = 1", "epochs = 1\ndownload = \"false\""), ["'download' must be true or false, got 'false'"]),
    # seed is the launcher's
    (("train_size = [100, 200]", "seed = [0, 1]"), ["'seed' cannot be an axis", "seeds = N"]),
])
def test_grid_values_that_would_collapse_clash_or_hide_are_refused_at_load(folder, cli, edit, needles):
    assert edit[0] in GRID
    (folder / "g.toml").write_text(GRID.replace(*edit))
    before = files(folder)
    for args in (["--status"], ["--launcher", "print"]):
        one_error(cli("bench", "grid", "g.toml", *args, cwd=folder), 2, *needles)
    assert files(folder) == before


# --------------------------------------------------------------------------- options that would do nothing

@pytest.mark.parametrize("args, needles", [
    # S15: cluster options without the cluster
    (["g.toml", "--partition", "gpu"], ["--partition is an option of --launcher slurm"]),
    (["g.toml", "--time", "1:00:00"], ["--time is an option of --launcher slurm"]),
    (["g.toml", "--mem", "4G", "--launcher", "print"], ["--mem is an option of --launcher slurm"]),
    (["g.toml", "--sbatch=--exclusive"], ["--sbatch is an option of --launcher slurm"]),
    (["g.toml", "--dry-run"], ["--dry-run is an option of --launcher slurm"]),
    # S16-S18: what would be written into job.sbatch unchecked
    (["g.toml", "--launcher", "slurm", "--dry-run", "--time", "99:99:99"], ["--time must look like", "below 60"]),
    (["g.toml", "--launcher", "slurm", "--dry-run", "--time", "1-24:00:00"], ["--time", "hours below 24"]),
    (["g.toml", "--launcher", "slurm", "--dry-run", "--mem", "lots"], ["--mem must be a size", "32G"]),
    (["g.toml", "--launcher", "slurm", "--dry-run", "--sbatch", "bogus"], ["--sbatch takes an sbatch option"]),
    (["g.toml", "--launcher", "slurm", "--dry-run", "--sbatch=--array=0-3"], ["writes --array itself"]),
    # S19
    (["--list", "digits"], ["--list lists the shipped grids and takes no grid (got 'digits')"]),
    (["--list", "--seeds", "2"], ["--list takes no other option than --json; --seeds"]),
    (["g.toml", "--launcher", "print", "--jobs", "2"], ["--jobs is an option of --launcher local"]),
    (["g.toml", "--status", "--gpus", "1"], ["--status launches nothing, so --gpus would do nothing"]),
    (["g.toml", "--status", "--jobs", "2"], ["--status launches nothing, so --jobs"]),
    (["g.toml", "--status", "--launcher", "slurm"], ["--status launches nothing, so --launcher"]),
    # S25: an empty --out is not the current folder
    (["g.toml", "--out", ""], ["--out", "needs a name"]),
    (["g.toml", "--data-dir", ""], ["--data-dir", "needs a name"]),
])
def test_grid_options_that_would_do_nothing_or_write_nonsense_are_refused(folder, cli, args, needles):
    before = files(folder)
    one_error(cli("bench", "grid", *args, cwd=folder), 2, *needles)
    assert files(folder) == before


@pytest.mark.parametrize("args, needles", [
    # S20-S23
    (["--no-figures"], ["--figures/--no-figures is about the files --report-dir writes"]),
    (["--force"], ["--force is about the files --report-dir writes"]),
    (["--attention-column", "100"], ["--attention-column is about the files --report-dir writes"]),
    (["--report-dir", "rep", "--attention-column", "100"], ["--attention-column chooses what --attention draws"]),
    (["--report-dir", "rep", "--attention-images", "8"], ["--attention-images chooses what --attention draws"]),
    (["--report-dir", "rep", "--attention", "--no-figures"], ["--attention draws a figure", "--no-figures"]),
    (["--grid", "g"], ["--grid picks one grid of a folder of runs; g.toml is a grid"]),
    # S26
    (["--report-dir", ""], ["--report-dir", "needs a name"]),
    (["--out", ""], ["--out", "needs a name"]),
])
def test_report_options_that_would_do_nothing_are_refused(folder, cli, args, needles):
    before = files(folder)
    one_error(cli("bench", "report", "g.toml", *args, cwd=folder), 2, *needles)
    assert files(folder) == before


def test_report_of_a_folder_refuses_out(folder, cli):
    (folder / "runs").mkdir()
    before = files(folder)
    one_error(cli("bench", "report", "runs", "--out", "elsewhere", cwd=folder), 2, "--out",
              "runs is itself the folder of runs reported")
    assert files(folder) == before


@pytest.mark.parametrize("args, needles", [
    (["--masses", "0.9,0.99,0.9"], ["--masses 0.9 is given twice"]),  # S27
    (["--paddings", "zero,circular,zero"], ["--paddings zero is given twice"]),  # S28
])
def test_exactness_refuses_repeated_values_that_would_skew_its_verdict(tmp_path, cli, args, needles):
    one_error(cli("bench", "exactness", *args, cwd=tmp_path), 2, *needles)


def test_exactness_that_cannot_fit_in_memory_is_refused_before_it_allocates(tmp_path, cli):
    one_error(cli("bench", "exactness", "--channels", "100000", cwd=tmp_path), 1, "GiB of memory", "free",
              "--channels")


def test_train_warns_once_when_the_warm_up_outlasts_the_training(tmp_path, cli):  # S29
    r = cli("train", "--dataset", "synthetic", "--depth", "1", "--epochs", "1", "--batch-size", "128",
            "--warmup-epochs", "50", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: warm up for 50 epochs but train for only 1: the learning rate never reaches its "
                        "peak (set --warmup-epochs too)"]
    r = cli("train", "--dataset", "synthetic", "--depth", "1", "--epochs", "2", "--batch-size", "128",
            "--warmup-epochs", "1", cwd=tmp_path)
    assert r.returncode == 0 and "warning" not in r.stderr


# --------------------------------------------------------------------------- cost before work

BIG = """\
name = "big"
[settings]
model = "vit-digits"
dataset = "digits"
epochs = 1
warmup_epochs = 0.5
[axes]
""" + "".join(f"{name} = [{', '.join(str(v) for v in values)}]\n" for name, values in (
    ("lr", [round(0.001 * (i + 1), 3) for i in range(20)]), ("weight_decay", [round(0.01 * i, 2) for i in range(20)]),
    ("batch_size", [8 * (i + 1) for i in range(20)]), ("val_size", [10 * i for i in range(20)])))


@pytest.mark.parametrize("args, runs", [
    (["g.toml", "--seeds", "100000000", "--status"], "600,000,000 runs (3 init x 2 train_size x 100000000 seeds)"),
    (["g.toml", "--seeds", "100000000", "--launcher", "print"], "600,000,000 runs"),
    (["big.toml", "--status"], "160,000 runs (20 lr x 20 weight_decay x 20 batch_size x 20 val_size x 1 seeds)"),
    (["big.toml", "--launcher", "print"], "160,000 runs"),
])
def test_a_grid_of_very_many_runs_is_counted_and_refused_before_it_is_expanded(folder, cli, args, runs):  # H1-H4
    import time

    (folder / "big.toml").write_text(BIG)
    before = files(folder)
    t0 = time.perf_counter()
    line = one_error(cli("bench", "grid", *args, cwd=folder), 2, runs, "--yes", "--seeds", "--only", "hours" if
                     "600" in runs else "minutes")
    # Refused from the count: expanding 600 million runs first would take hours (a hang bound, not a speed).
    assert time.perf_counter() - t0 < 600 and "expanding them alone would take about" in line
    assert files(folder) == before
    one_error(cli("bench", "report", args[0], "--seeds", "100000000", cwd=folder), 2, "runs", "--yes")


def test_yes_expands_a_large_grid_with_progress(folder, cli, monkeypatch):
    import structinit.experiments.expand as expand_module

    monkeypatch.setattr(expand_module, "MAX_RUNS", 10)
    monkeypatch.setattr(expand_module, "PROGRESS_FROM", 1)
    one_error(cli("bench", "grid", "g.toml", "--status", cwd=folder), 2, "grid g has 12 runs", "--yes")
    r = cli("bench", "grid", "g.toml", "--status", "--yes", cwd=folder)
    assert r.returncode == 0 and "12 runs in runs" in r.stdout, r.stderr
    from structinit.experiments.gridspec import load_grid

    seen = []
    expand_module.expand(load_grid(str(folder / "g.toml")), runs_dir=folder / "runs", max_runs=None,
                         progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (12, 12)
    (folder / "runs").mkdir()
    one_error(cli("bench", "report", "runs", "--yes", cwd=folder), 2, "--yes", "would do nothing")


def test_environment_mistakes_are_found_once_per_grid_before_anything_runs(folder, cli):
    cifar = GRID.replace('dataset = "digits"', 'dataset = "cifar10"')
    (folder / "c.toml").write_text(cifar)
    (folder / "empty").mkdir()
    before = files(folder)
    line = one_error(cli("bench", "grid", "c.toml", "--data-dir", "empty", cwd=folder), 2,
                     "12 run(s) to launch read cifar10", "missing: data_batch_1", "--data-dir", "--set download=true")
    assert "data_dir" not in line and files(folder) == before and not (folder / "runs").exists()
    # elsewhere (print, slurm) the nodes may see other files: said once, then launched
    r = cli("bench", "grid", "c.toml", "--data-dir", "empty", "--launcher", "print", "--only", "init=mimetic",
            cwd=folder)
    assert r.returncode == 0 and r.stderr.count("warning: 4 run(s) to launch read cifar10") == 1, r.stderr
    assert len(r.stdout.strip().splitlines()) == 4
    # a GPU asked for on a machine without one
    one_error(cli("bench", "grid", "g.toml", "--set", "device=cuda", "--out", "gpu-runs", cwd=folder), 2,
              "12 run(s) to launch ask for device cuda", "no CUDA GPU")
    assert not (folder / "gpu-runs").exists()


def test_iterative_solves_are_estimated_before_they_start():
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import estimate_seconds

    small = estimate_seconds(SolveConfig(grid=(8, 8), dim=64, heads=4, recipe="paper", params={"iters": 100}), "cpu")
    big = estimate_seconds(SolveConfig(grid=(64, 64), dim=768, heads=12, layers=12, recipe="paper"), "cpu")
    assert small < 30 and big > 3600 * 10  # the shape: hours to days, not minutes
    assert estimate_seconds(SolveConfig(grid=(64, 64), dim=768, heads=12, layers=12), "cpu") is None  # fast


@pytest.mark.slow  # a solve process started and stopped
def test_a_long_solve_says_its_estimate_and_its_progress(tmp_path):  # H5
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "structinit", "solve", "--grid", "32x32", "--dim", "192", "--heads", "3",
           "--layers", "12", "--recipe", "paper", "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    lines, t0 = [], time.monotonic()
    try:
        while time.monotonic() - t0 < 300:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line.strip())
            if "left)" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    estimate = [ln for ln in lines if "estimated" in ln]
    assert estimate and "10000 Adam steps" in estimate[0] and ("hours" in estimate[0] or "days" in estimate[0]), lines
    assert any(ln.startswith("solving paper: ") and "left)" in ln for ln in lines), lines
    assert lines.index(estimate[0]) == 0  # said before the first step
