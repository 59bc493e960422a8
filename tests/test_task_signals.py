"""A task stopped by a signal at any moment: while it starts, in its first epoch, after its last
epoch as it exits, under torchrun with the signal sent to every process (as ``scancel`` and SLURM's
``--signal`` do), and a local launcher stopped while its workers start. Each time the process ends
as documented (``bench run``: exit 0 and ``interrupted RUN``; ``train``: exit 143 and one line;
the launcher: exit 130), the run keeps its last checkpoint and nothing partial, and the next task
resumes it. The moments are reached by watching the processes (their signal handlers in
``/proc/PID/status``, the run's files) and, where a moment must last, by freezing them with
SIGSTOP; nothing waits for a time to pass. Last, ``requeue_self`` against a stand-in ``scontrol``
that fails the way a busy controller does (the real one: tests/test_bench_slurm.py)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import digest
from conftest import wait_for as poll
from grids import TINY_GRID, expand_text, variant

from structinit.experiments.launch import prepare_runs
from structinit.training.rundir import RunDir, checkpoint_info

REPO = Path(__file__).resolve().parents[1]
TINY = variant(TINY_GRID, baseline="mimetic", val_size=100)



def wait_for(cond):
    """Polled every 5 ms: the moments these tests catch (a handler just installed) are short."""
    return poll(cond, timeout=600, every=0.005)

def popen(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "structinit", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def structinit(*args, cwd, timeout=1200):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)



def signal_set(pid: int, field: str) -> int:
    """A signal bit mask of ``/proc/PID/status`` (``SigCgt``: handled, ``SigIgn``, ``SigBlk``); 0
    once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def handles(pid: int, sig: int) -> bool:
    return bool(signal_set(pid, "SigCgt") & (1 << (sig - 1)))


def descendants(pid: int):
    """``pid`` and every process below it (from /proc), parents first."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def each(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def log_of(run: Path) -> str:
    return (run / "log.txt").read_text() if (run / "log.txt").exists() else ""


def epochs_of(run: Path):
    return [m["epoch"] for m in RunDir(run).read_metrics()]


def leftovers(folder: Path):
    """Temp files of a write that did not finish (atomic writes leave ``.NAME.PID.RAND.tmp``)."""
    return sorted(p.name for p in folder.rglob("*.tmp"))


@pytest.mark.slow
def test_a_task_stopped_while_it_starts_in_its_first_epoch_or_as_it_exits_keeps_the_run(tmp_path):
    # one epoch of 2-image steps: seconds of training, so the first epoch is a moment that lasts
    grid = variant(TINY, batch_size=2)
    ex = expand_text(grid, tmp_path, overrides=["epochs=1"], seeds=1, only=["init=mimetic"])
    run = ex.run_dir(prepare_runs(ex)[0])
    config = digest(run / "config.json")

    # 1. while it starts: as soon as it handles SIGTERM (its entry point's handler, in before the
    # command line and torch load). It says the run was interrupted and leaves it as it was (or, on a
    # machine fast enough to begin training before the signal lands, stops at the first step).
    proc = popen("bench", "run", run, cwd=tmp_path)
    wait_for(lambda: handles(proc.pid, signal.SIGTERM) or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.strip() == f"interrupted {run}", (proc.returncode, out, err)
    assert RunDir(run).state == "fresh" and digest(run / "config.json") == config
    assert "Traceback" not in err and leftovers(run) == []

    # 2. in its first epoch: frozen once it trains, signalled, thawed. The run has no checkpoint, and
    # the grid's config.json, which train replaced with its own, is put back for the next task.
    proc = popen("bench", "run", run, cwd=tmp_path)
    wait_for(lambda: "trainable params" in log_of(run) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert epochs_of(run) == []
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.strip() == f"interrupted {run}", (proc.returncode, out, err)
    assert "task stopped (SIGTERM); no epoch had finished: the next task starts the run afresh" in log_of(run)
    assert json.loads((run / "task.json").read_text())["state"] == "interrupted"
    assert RunDir(run).state == "fresh" and digest(run / "config.json") == config and leftovers(run) == []

    # 3. as it exits: the run finished and was reported; once the task has let go of its handler
    # (ignoring the signal, not putting the default back) a SIGTERM changes nothing
    proc = popen("bench", "run", run, cwd=tmp_path)
    wait_for(lambda: "task done" in log_of(run) or proc.poll() is not None)
    wait_for(lambda: not handles(proc.pid, signal.SIGTERM))
    assert proc.poll() is None, "the task exited before it could be signalled"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.startswith(f"finished {run}: final "), (proc.returncode, out, err)
    final = json.loads((run / "final.json").read_text())
    assert final["resumed_from"] is None and epochs_of(run) == [1] and leftovers(run) == []
    again = structinit("bench", "run", run, "--json", cwd=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)[0]["state"] == "already-finished"


@pytest.mark.slow
def test_a_task_whose_data_loader_workers_get_the_sigterm_too_stops_and_resumes(tmp_path):
    """A run read from disk (``imagefolder``) streams through DataLoader workers, which a scheduler
    signals with the rest of the job (here: the task's process group). They leave the signal to the
    task: it stops at its next step instead of failing on a worker "killed by signal"."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            for j in range(100):
                path = tmp_path / "data" / split / f"c{c}" / f"{j}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (24, 20), (200 * c, 40 + j, 90)).save(path)
    grid = variant(TINY, dataset="imagefolder", data_dir=str(tmp_path / "data"), image_size=16, patch=4,
                   batch_size=4, workers=2, val_size=None)
    ex = expand_text(grid, tmp_path, overrides=["epochs=6"], seeds=1, only=["init=mimetic"])
    run = ex.run_dir(prepare_runs(ex)[0])
    proc = popen("bench", "run", run, "--threads", "1", cwd=tmp_path)
    wait_for(lambda: epochs_of(run) or proc.poll() is not None)
    # the next epoch's loader is up: the task and its two workers
    tree = wait_for(lambda: (lambda t: t if len(t) >= 3 else None)(descendants(proc.pid)) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert proc.poll() is None and len(epochs_of(run)) < 6
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.strip() == f"interrupted {run}", (proc.returncode, out, err)
    kept = checkpoint_info(run / "checkpoint.pt")["epoch"]
    assert f"task stopped (SIGTERM); the checkpoint of epoch {kept} is kept" in log_of(run)
    assert "killed by signal" not in err + log_of(run) and "Traceback" not in err
    assert not any(alive(p) for p in tree) and leftovers(run) == []
    done = structinit("bench", "run", run, "--threads", "1", "--json", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)[0]["state"] == "finished", done.stdout + done.stderr
    assert json.loads((run / "final.json").read_text())["resumed_from"] == kept and epochs_of(run) == list(range(1, 7))


@pytest.mark.slow
def test_train_stopped_by_sigterm_says_so_in_one_line_exits_143_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--patch", "2", "--depth", "1", "--dim", "32", "--heads", "2", "--lr", "0.01", "--batch-size",
            "32", "--warmup-epochs", "0.5", "--val-size", "100", "--epochs", "6", "--out", out]
    proc = popen(*args, cwd=tmp_path)
    wait_for(lambda: epochs_of(out) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGSTOP)  # an epoch takes a fraction of a second: frozen, it cannot finish the run
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=600)
    kept = checkpoint_info(out / "checkpoint.pt")["epoch"]
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == (f"error: interrupted (SIGTERM); the checkpoint of epoch {kept} is kept "
                                            f"in {out}: the same command with --resume continues the run")
    assert 1 <= kept < 6 and not (out / "final.json").exists() and leftovers(out) == []
    done = structinit("train", "--out", out, "--resume", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resumed_from"] == kept and epochs_of(out) == list(range(1, 7))


@pytest.mark.slow
def test_a_torchrun_task_whose_every_process_is_signalled_stops_them_together_and_resumes(tmp_path):
    """SLURM signals every process of a job step: the task, torchrun's agent and the training
    processes. Time limit (USR2) first, then scancel (SIGTERM), then the run finishes."""
    ex = expand_text(TINY, tmp_path, overrides=["epochs=12"], seeds=1, only=["init=mimetic"])
    run = ex.run_dir(prepare_runs(ex)[0])
    kept = 0
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        proc = popen("bench", "run", run, "--nproc", "2", "--threads", "1", cwd=tmp_path)
        wait_for(lambda proc=proc, kept=kept: len(epochs_of(run)) > kept or proc.poll() is not None)
        tree = descendants(proc.pid)
        each(tree, signal.SIGSTOP)  # the moment lasts: no process steps on while the others are signalled
        assert len(tree) >= 4 and len(epochs_of(run)) < 12  # the task, the agent, two training processes
        each(tree, sig)
        each(tree, signal.SIGCONT)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and out.strip() == f"interrupted {run}", (proc.returncode, out, err)
        assert not any(alive(p) for p in tree)
        log = log_of(run)
        # torchrun's 40-line report of its processes' exit code 143 is left out of both
        assert "Traceback" not in err and "Traceback" not in log and "ChildFailedError" not in log, err
        assert "lines of its failure report left out" in log
        previous, kept = kept, checkpoint_info(run / "checkpoint.pt")["epoch"]
        assert kept > previous and leftovers(run) == []
        # rank 0 stopped at a step, as the other did (an all-reduce each step), and said what it kept
        assert f"error: interrupted (SIGTERM); the checkpoint of epoch {kept} is kept" in log
        why = "SIGUSR2 (time limit or preemption)" if sig == signal.SIGUSR2 else "SIGTERM"
        assert f"task stopped ({why}); the checkpoint of epoch {kept} is kept" in log, log[-3000:]
    r = structinit("bench", "run", run, "--nproc", "2", "--threads", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["state"] == "finished", r.stdout + r.stderr
    final = json.loads((run / "final.json").read_text())
    assert final["world_size"] == 2 and final["resumed_from"] == kept and epochs_of(run) == list(range(1, 13))


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_local_grid_stopped_while_its_workers_start_exits_130_and_a_rerun_trains_it(tmp_path, how):
    """Ctrl-C (or SIGTERM) to the launcher's process group, as a terminal (or a service manager)
    sends it, as soon as its workers exist: each starts with the signals blocked, so none dies in
    its start-up, and the launcher, which handles SIGTERM before it starts them, exits 130."""
    (tmp_path / "tiny.toml").write_text(TINY)
    only = ["--only", "init=mimetic", "--jobs", "2"]
    proc = popen("bench", "grid", "tiny.toml", *only, cwd=tmp_path)
    workers = wait_for(lambda: [p for p in descendants(proc.pid)[1:] if b"spawn_main" in _cmdline(p)]
                       or proc.poll() is not None)
    assert proc.poll() is None
    os.killpg(proc.pid, how)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "leaked" not in err
    assert "interrupted; the same command continues the grid" in err
    assert not any(alive(p) for p in workers)
    runs = [p for p in (tmp_path / "runs").iterdir() if len(p.name) == 12]
    assert len(runs) == 2 and all(RunDir(r).state == "fresh" and not (r / "task.json").exists() for r in runs)
    if how == signal.SIGTERM:  # (once is enough)
        again = structinit("bench", "grid", "tiny.toml", *only, "--json", cwd=tmp_path)
        assert again.returncode == 0 and json.loads(again.stdout)["outcomes"] == {"finished": 2}, again.stderr


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


# --------------------------------------------------------------------------- requeue_self

SCONTROL = """\
# stands in for SLURM's scontrol (a program that keeps the signal mask it is started with, as the real
# one does; a shell would clear it): answers from the files in its folder, one per call, in order
import pathlib, sys
here = pathlib.Path(__file__).parent
n = len(list(here.glob("called-*")))
(here / f"called-{n}").write_text(" ".join(sys.argv[1:]) + "\\n")
(here / f"mask-{n}").write_text(next(l for l in open("/proc/self/status") if l.startswith("SigBlk")))
answer = here / f"answer-{n}"
if answer.exists():
    sys.stderr.write(answer.read_text())
    sys.exit(1)
"""


@pytest.mark.parametrize("answers, requeued, calls, said", [
    ([], True, 1, "requeued SLURM job 7_1; the run resumes"),
    (["slurm_requeue error: Socket timed out on send/recv operation"], True, 2, "requeued SLURM job 7_1"),
    (["slurm_requeue error: Unable to contact slurm controller (connect failure)"] * 3, False, 3,
     "scontrol requeue 7_1 failed: slurm_requeue error: Unable to contact slurm controller"),
    (["slurm_requeue error: Job is pending execution"], True, 1, "SLURM job 7_1 is requeued already"),
    (["slurm_requeue error: Requested operation is presently disabled"], False, 1,
     "scontrol requeue 7_1 failed: slurm_requeue error: Requested operation is presently disabled"),
])
def test_requeue_self_tries_again_when_the_controller_does_not_answer(tmp_path, monkeypatch, answers, requeued,
                                                                      calls, said):
    from structinit.experiments.task import requeue_self

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!{sys.executable}\n" + SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    for i, answer in enumerate(answers):
        (bin_dir / f"answer-{i}").write_text(answer + "\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    lines = []
    assert requeue_self(lines.append, pause=0.0) is requeued
    assert sorted(p.name for p in bin_dir.glob("called-*")) == [f"called-{i}" for i in range(calls)]
    assert all((bin_dir / f"called-{i}").read_text().split() == ["requeue", "7_1"] for i in range(calls))
    # SLURM ends a job it requeues with SIGTERM: the scontrol that asked must not die of it first
    blocked = int((bin_dir / "mask-0").read_text().split()[1], 16)
    assert blocked & (1 << (signal.SIGTERM - 1)) and blocked & (1 << (signal.SIGUSR2 - 1))
    assert len(lines) == 1 and lines[0].startswith(said), lines


#: Two seeds of the authors' 2024 init on the stock vit-digits: two iterative solves of 10,000 Adam
#: steps each before any run starts (the setup), long enough to show progress and to be stopped in.
SETUP = variant(TINY_GRID, name="setup", seeds=2, epochs=1, patch=None, depth=None, dim=None, heads=None,
                axes='[[axes.init]]\nid = "impulse-2024"\ninit = "impulse-2024"\n')
SETUP_LINE = r"^setup: artifact (\d)/2: .*recipe released: \d+/10000 \(\d+\.\ds, about \d+ s left\)$"


@pytest.mark.slow
def test_a_grid_setup_shows_its_progress_and_a_sigterm_in_it_is_one_line_and_a_rerun_completes(tmp_path):
    """The setup (the init artifacts solved before the runs) prints lines that name the artifact's
    count and the time left; a SIGTERM in it ends the command with one line naming the signal and
    the phase, exit 130 as for the runs; the rerun solves only what was not solved and completes."""
    import re

    (tmp_path / "setup.toml").write_text(SETUP)
    proc = popen("bench", "grid", "setup.toml", "--launcher", "print", cwd=tmp_path)
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line.rstrip("\n"))
        if re.match(SETUP_LINE, seen[-1]):
            break
    assert proc.poll() is None, seen
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    lines = [*seen, *err.splitlines()]
    assert proc.returncode == 130 and out == "" and "Traceback" not in err, (proc.returncode, lines)
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]] == [
        "error: interrupted (SIGTERM) while solving the init artifacts before the runs (the setup), before any "
        "run started; what was solved is kept in the cache, and the same command continues the grid"], lines
    solved_before = sum(1 for line in lines if line.startswith("solved impulse artifact"))
    again = structinit("bench", "grid", "setup.toml", "--launcher", "print", cwd=tmp_path)
    assert again.returncode == 0 and len(again.stdout.splitlines()) == 2, again.stderr  # one train command per run
    solved_now = [line for line in again.stderr.splitlines() if line.startswith("solved impulse artifact")]
    assert solved_before + len(solved_now) == 2, (lines, again.stderr)  # none solved twice, none left out
