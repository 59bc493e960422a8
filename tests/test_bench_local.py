"""The local launcher and the task runner with real training runs on digits: every run once, a rerun
launches nothing, Ctrl-C stops cleanly and a rerun continues, a task stopped by SIGTERM resumes from
its checkpoint, failures are reported with their last log line. A task under torchrun, and a task
or launcher stopped at other moments: tests/test_task_signals.py."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from grids import TINY_GRID, expand_text, variant

from structinit.experiments.launch import prepare_runs
from structinit.experiments.status import grid_status, run_status
from structinit.training.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
TINY = variant(TINY_GRID, baseline="mimetic", val_size=100,
               append="init_params = { data_fit = 30 }\n")  # the impulse value's: a short data fit


def structinit(*args, cwd, timeout=1200, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def popen(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "structinit", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)



def epochs_of(run: Path):
    return [m["epoch"] for m in RunDir(run).read_metrics()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of this test's own children does not count
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_local_grid_runs_every_run_once_and_a_rerun_launches_nothing(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = structinit("bench", "grid", "tiny.toml", "--jobs", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["to_launch"] == 4 and doc["outcomes"] == {"finished": 4} and doc["jobs"] == 2 and doc["threads"] == 1
    assert doc["presolve"]["artifacts"] == 2  # impulse at seeds 0 and 1, solved before the runs started
    assert 0 <= doc["overhead_seconds_per_run"] < 60
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name not in ("grids",))
    assert len(runs) == 4
    for run in runs:
        final = json.loads((run / "final.json").read_text())
        assert epochs_of(run) == [1, 2] and final["final_acc"] > 20 and final["best_epoch"]["selected_on"] == "val"
        task = json.loads((run / "task.json").read_text())
        assert task["state"] == "finished" and not alive(task["pid"])
        # the impulse runs found their artifact solved already
        cfg = json.loads((run / "config.json").read_text())
        log = (run / "log.txt").read_text()
        assert "Warning:" not in log and ".py:" not in log  # no Python warning text: one line each
        if cfg["config"]["init"] == "impulse":
            assert cfg["init_report"]["artifact"]["cached"] is True

    again = structinit("bench", "grid", "tiny.toml", cwd=tmp_path)
    assert again.returncode == 0 and "nothing to launch: 4 of 4 runs finished" in again.stdout
    status = structinit("bench", "grid", "tiny.toml", "--status", "--json", cwd=tmp_path)
    assert json.loads(status.stdout)["counts"] == {"finished": 4, "running": 0, "failed": 0, "damaged": 0, "pending": 0}


@pytest.mark.slow
def test_a_warning_of_the_library_is_one_line_of_the_runs_log(tmp_path):
    # one step of data fit leaves the init partly structured where a token's 4 values fill a stream of 4: the
    # library warns, the log says it once, its advice written as the grid's key
    weak = TINY.replace("data_fit = 30", "data_fit = 1")
    ex = expand_text(weak, tmp_path, overrides=["epochs=1", "dim=4"], seeds=1)
    run = next(ex.run_dir(k) for k in prepare_runs(ex) if "impulse" in (ex.run_dir(k) / "config.json").read_text())
    r = structinit("bench", "run", run, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    log = (run / "log.txt").read_text()
    said = [line for line in log.splitlines() if "warning:" in line]
    assert len(said) == 1 and "warning: impulse: the data fit left layer 0 hitting its offsets in" in said[0], log
    assert "for structure try init_params.position_subspace = true (" in said[0]
    assert "Warning:" not in log and ".py:" not in log


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_a_rerun_continues(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    # one run of 6 epochs: 4 left to interrupt after the second (a slow machine spends 20 s and more on each)
    only = ["--set", "epochs=6", "--seeds", "1", "--only", "init=mimetic"]
    proc = popen("bench", "grid", "tiny.toml", *only, cwd=tmp_path)
    runs = tmp_path / "runs"
    first = wait_for(lambda: next((p for p in runs.glob("*") if len(epochs_of(p)) >= 2), None))
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "the same command continues the grid" in err and "Traceback" not in err
    task = json.loads((first / "task.json").read_text())
    assert task["state"] == "interrupted" and not alive(task["pid"])
    stopped_at = len(epochs_of(first))
    # the run's log names the signal the user sent, which the launcher passed on as SIGTERM
    assert (f"task stopped (SIGINT to the launcher); the checkpoint of epoch {stopped_at} is kept"
            in (first / "log.txt").read_text())
    assert 2 <= stopped_at < 6 and not (first / "final.json").exists()
    st = run_status(first)
    assert st.state == "pending" and st.resumable
    again = structinit("bench", "grid", "tiny.toml", *only, "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["outcomes"] == {"finished": 1}
    final = json.loads((first / "final.json").read_text())
    assert final["resumed_from"] == stopped_at and epochs_of(first) == list(range(1, 7))


@pytest.mark.slow
def test_a_task_stopped_by_sigterm_resumes_from_its_checkpoint(tmp_path):
    ex = expand_text(TINY, tmp_path, overrides=["epochs=12"], seeds=1)
    run = ex.run_dir(prepare_runs(ex)[0])
    proc = popen("bench", "run", run, "--threads", "1", cwd=tmp_path)
    wait_for(lambda: len(epochs_of(run)) >= 2)
    # Frozen, the task holds its run but cannot finish it while a second task starts (seconds on a
    # busy machine, longer than the 10 epochs left); the SIGTERM waits for it to be thawed.
    os.killpg(proc.pid, signal.SIGSTOP)
    assert len(epochs_of(run)) < 12
    assert run_status(run).state == "running"  # its lock is held (by a live task, frozen)
    busy = structinit("bench", "run", run, "--json", cwd=tmp_path)  # a second task leaves the run alone
    assert json.loads(busy.stdout)[0]["state"] == "busy"
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and f"interrupted {run}" in out, (proc.returncode, out, err)
    k = len(epochs_of(run))
    assert f"task stopped (SIGTERM); the checkpoint of epoch {k} is kept" in (run / "log.txt").read_text()
    assert RunDir(run).state == "resumable" and run_status(run).state == "pending"
    done = structinit("bench", "run", run, "--json", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)[0]["state"] == "finished"
    assert json.loads((run / "final.json").read_text())["resumed_from"] == k and epochs_of(run) == list(range(1, 13))
    again = structinit("bench", "run", run, "--json", cwd=tmp_path)
    assert json.loads(again.stdout)[0]["state"] == "already-finished"


@pytest.mark.slow
def test_a_failing_run_is_reported_and_retried(tmp_path):
    # a batch larger than the training set: found by train itself, once the data is loaded (a dataset
    # missing for every run is refused before launch: tests/test_hostile_grid.py)
    grid = variant(TINY, train_size=16)
    (tmp_path / "bad.toml").write_text(grid)
    r = structinit("bench", "grid", "bad.toml", "--seeds", "1", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "2 failed" in r.stdout and "is larger than the 16 training images" in r.stderr
    st = structinit("bench", "grid", "bad.toml", "--seeds", "1", "--status", cwd=tmp_path)
    assert st.returncode == 0 and "0 finished, 0 running, 2 failed, 0 pending" in st.stdout
    assert st.stdout.count("is larger than the 16 training images") == 2
    ex = expand_text(grid, tmp_path / "runs", file="bad.toml", seeds=1)
    assert grid_status(ex).counts["failed"] == 2
    assert len(prepare_runs(ex)) == 2  # a rerun retries failed runs
