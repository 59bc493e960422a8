"""bench grid / report / run at the command line: the listing, the print launcher, and every kind of bad
input as one `error:` line with exit code 2, nothing written."""

import json
import re
import shlex

import pytest
from conftest import error_line, says
from grids import DIGITS, variant

GRID = variant(DIGITS, name="cli")


def one_error(r, code=2):
    assert r.returncode == code, (r.returncode, r.stderr)
    return error_line(r.stderr)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "grid.toml").write_text(GRID)
    return tmp_path


def test_list_shows_every_shipped_grid_with_its_run_count(cli):
    r = cli("bench", "grid", "--list")
    assert r.returncode == 0
    counts = re.findall(r"^(\S+) +(\d+) runs \((.*?)\)", r.stdout, flags=re.M)
    assert ("digits", "180", "9 init x 4 train_size x 5 seeds") in counts
    assert ("mnist1d", "100", "10 init x 2 data x 5 seeds") in counts
    assert ("fashion-196", "200", "8 init x 5 train_size x 5 seeds") in counts
    assert ("table6", "216", "9 pseudo x 2 qk x 2 model x 2 filter x 3 seeds") in counts
    assert ("vit-t16", "54", "6 init x 3 train_size x 3 seeds") in counts
    assert len(counts) == 12
    doc = json.loads(cli("bench", "grid", "--list", "--json").stdout)
    assert {d["name"]: d["runs"] for d in doc}["table4"] == 72


def test_print_launcher_lists_the_train_commands(cli, folder):
    r = cli("bench", "grid", "grid.toml", "--launcher", "print", "--seeds", "2", cwd=folder)
    assert r.returncode == 0, r.stderr
    cmds = r.stdout.strip().splitlines()
    assert len(cmds) == 4 and all(c.startswith("structinit train --model vit-digits --dataset digits") for c in cmds)
    assert sum("--init impulse" in c for c in cmds) == 2 and all(c.endswith("--resume") for c in cmds)
    out = shlex.split(cmds[0])[-2]
    assert (folder / out / "config.json").is_file()  # the run folders and the manifest are prepared
    st = cli("bench", "grid", "grid.toml", "--seeds", "2", "--status", "--json", cwd=folder)
    assert json.loads(st.stdout)["counts"] == {"finished": 0, "running": 0, "failed": 0, "damaged": 0, "pending": 4}


@pytest.mark.parametrize("args, message", [
    (["bench", "grid", "digit"], "error: unknown grid 'digit' (did you mean 'digits'?); shipped grids: digits, "),
    (["bench", "grid"], "error: give a grid: a shipped name"),
    (["bench", "grid", "grid.toml", "--set", "epoch=3"],
     "error: --set epoch=3: unknown setting 'epoch' (did you mean 'epochs'?)"),
    (["bench", "grid", "grid.toml", "--set", "epochs=many"],
     "error: --set epochs=many: 'epochs' must be an integer, got 'many'"),
    (["bench", "grid", "grid.toml", "--set", "epochs"], "error: --set must look like NAME=VALUE, got 'epochs'"),
    (["bench", "grid", "grid.toml", "--set", "lr=-1"], "error: grid.toml: cell init=mimetic: lr must be positive"),
    (["bench", "grid", "grid.toml", "--set", "init_params.alpha9=5"],
     "error: --set init_params.alpha9: no init method of this grid takes it"),
    (["bench", "grid", "grid.toml", "--seeds", "0"], "error: --seeds: the seed count must be at least 1"),
    (["bench", "grid", "grid.toml", "--launcher", "cloud"], "error: unknown --launcher 'cloud'; choose one of local"),
    (["bench", "grid", "grid.toml", "--launcher", "slurm", "--dry-run", "--time", "soon"],
     "error: --time must look like HH:MM:SS"),
    (["bench", "grid", "nope.toml"], "error: grid file nope.toml does not exist"),
    (["bench", "grid", "grid.toml", "--only", "inits=mimetic"],
     "error: --only: unknown axis 'inits' (did you mean 'init'?); grid cli has init"),
    (["bench", "grid", "grid.toml", "--only", "init=mimetc"],
     "error: --only: axis 'init' has no value 'mimetc' (did you mean 'mimetic'?); it has mimetic, impulse"),
    (["bench", "grid", "grid.toml", "--only", "init"], "error: --only must look like AXIS=ID[,ID...], got 'init'"),
    (["bench", "report", "nothing-here"], "error: unknown grid 'nothing-here'"),
    (["bench", "report", "grid.toml"], "error: no runs: runs does not exist"),
    (["bench", "run", "runs/0123456789ab"], "error: run folder runs/0123456789ab does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(cli, folder, args, message):
    line = one_error(cli(*args, cwd=folder))
    assert line.startswith(message), line
    assert not (folder / "runs").exists()


@pytest.mark.parametrize("edit, message", [
    (('rows = "init"', 'rows = "inits"'), "error: grid.toml:3: unknown axis 'inits' in 'rows' (did you mean 'init'?)"),
    (('epochs = 2', 'epoch = 2'), "error: grid.toml:7: [settings] unknown setting 'epoch' (did you mean 'epochs'?)"),
    (('init = "impulse"', 'init = "impluse"'), "error: grid.toml: cell init=impulse: unknown init method "
                                               "'impluse'; init takes one of"),
    (('seeds = 1', 'seeds = 1\nseeds = 2'), "error: grid.toml:3: Cannot overwrite a value (column 10)"),
])
def test_a_typo_in_a_grid_file_says_which_key_and_line(cli, folder, edit, message):
    (folder / "grid.toml").write_text(GRID.replace(*edit))
    line = one_error(cli("bench", "grid", "grid.toml", cwd=folder))
    assert line.startswith(message), line
    assert not (folder / "runs").exists()


def test_a_report_needs_runs(cli, folder):
    (folder / "empty").mkdir()
    line = one_error(cli("bench", "report", "empty", cwd=folder))
    assert line.startswith("error: no runs in empty: no sub-folder holds a config.json")
    (folder / "runs").mkdir()
    line = one_error(cli("bench", "report", "grid.toml", cwd=folder))
    assert line.startswith("error: no runs of grid.toml in runs yet")
    line = one_error(cli("bench", "report", "runs", "--set", "epochs=1", cwd=folder))
    assert says(line, "--set, --seeds, --only, --runs-csv and --baseline", "grid")
    assert list((folder / "runs").iterdir()) == []


@pytest.mark.slow
def test_an_installed_wheel_ships_the_grids_and_the_job_template(tmp_path):
    import os
    import subprocess
    import sys
    import zipfile

    from conftest import REPO

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    names = zipfile.ZipFile(next(wheels.glob("structinit-*.whl"))).namelist()
    grids = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("structinit/data/grids/"))
    assert grids == sorted(p.name for p in (REPO / "structinit" / "data" / "grids").glob("*.toml"))
    assert "structinit/experiments/templates/slurm_array.sbatch" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(next(wheels.glob("*.whl")))], check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(target), PATH="/nonexistent")
    run = [sys.executable, "-m", "structinit", "bench", "grid"]
    r = subprocess.run(run + ["--list"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "table6" in r.stdout
    r = subprocess.run(run + ["table2", "--only", "init=kaiming", "--seeds", "1", "--launcher", "slurm", "--dry-run",
                              "--json"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    script = json.loads(r.stdout)["script"]
    assert "#SBATCH --array=0-3" in open(script).read()
