"""Nothing on disk is trusted: a run folder is written by one process at a time (its lock), a run is
finished only when its files check out (``final.json`` against ``config.json`` and the checkpoint),
damaged runs are reported as such and retrained with their files set aside (never deleted), and a
damaged grid manifest is written anew instead of breaking the reports of other grids. Real files,
real training runs, real processes."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import error_line, hold_lock
from grids import MIMETIC_KAIMING, TINY_GRID, expand_text, trained_grid, variant

from structinit.experiments.launch import prepare_runs
from structinit.experiments.report import collect, markdown, reports_for_folder
from structinit.experiments.status import grid_status, status_text
from structinit.experiments.task import run_task
from structinit.training.rundir import RunBusy, RunDir

REPO = Path(__file__).resolve().parents[1]
GRID = variant(TINY_GRID, seeds=3, train_size=64, epochs=1, axes=MIMETIC_KAIMING)


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def one_error(r, code, *needles):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    line = error_line(r.stderr)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The tiny grid with all six runs finished, in a folder the tests copy before they damage it."""
    root = tmp_path_factory.mktemp("integrity")
    trained_grid(root, GRID)
    return root


@pytest.fixture
def grid(finished, tmp_path):
    """A copy of the finished grid (``grid.toml`` and ``runs/``) and its expansion there."""
    shutil.copytree(finished, tmp_path / "g")
    folder = tmp_path / "g"
    ex = expand_text(GRID, folder / "runs", file="grid.toml", command="structinit bench grid grid.toml")
    return folder, ex


# --------------------------------------------------------------------------- one writer per run folder

def test_a_run_folder_held_by_another_process_is_refused_by_train_and_the_task(grid, cli):
    folder, ex = grid
    run = ex.run_dir(ex.cells[0])
    before = {p.name: sha(p) for p in run.iterdir() if p.is_file()}
    (run / "final.json").unlink()  # a run to continue, so nothing stops train but the lock
    del before["final.json"]
    holder = hold_lock(run)
    try:
        r = cli("train", "--out", run, "--resume")
        one_error(r, 1, f"run folder {run} is in use", "another process")
        assert run_task(run, threads=1).state == "busy"
        with pytest.raises(RunBusy, match="in use"):
            RunDir(run).lock()
    finally:
        holder.kill()
        holder.wait()
    # nothing written while refused (the killed holder leaves its .lock, which the kernel unlocked)
    assert {p.name: sha(p) for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before
    # reentrant in one process: the task holds the lock while its own call of train() takes it again
    assert run_task(run, threads=1).state == "finished"
    assert not (run / ".lock").exists()  # the lock file exists only while a process holds it


def test_a_fresh_run_that_fails_leaves_no_folder_and_no_lock(tmp_path, cli):
    r = cli("train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "100000", "--out", tmp_path / "a" / "b")
    one_error(r, 2, "--batch-size")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two training processes
def test_two_trainings_of_one_folder_started_at_once_one_trains_the_other_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "structinit", "train", "--dataset", "synthetic", "--epochs", "6", "--out", "D",
           "--resume"]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (tmp_path / "D" / ".lock").exists():
        assert first.poll() is None and time.monotonic() - t0 < 300, first.communicate()
        time.sleep(0.05)
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    one_error(second, 1, "run folder D is in use")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    epochs = [m["epoch"] for m in RunDir(tmp_path / "D").read_metrics()]
    assert epochs == [1, 2, 3, 4, 5, 6]  # once each, in order: no second writer interleaved
    assert sorted(p.name for p in (tmp_path / "D").iterdir()) == ["best.pt", "checkpoint.pt", "config.json",
                                                                    "final.json", "metrics.jsonl"]


# --------------------------------------------------------------------------- finished means checked

def damage(ex):
    """Damage four of the six runs as a disk, an editor or a careless copy would; returns
    ``{key: (what was done, files as they were damaged)}``."""
    runs = [ex.run_dir(c) for c in ex.unique_cells()]
    (runs[0] / "final.json").write_text((runs[0] / "final.json").read_text()[:40])  # cut short
    (runs[1] / "final.json").write_text("[]")  # parses, but is no result
    shutil.copy2(runs[3] / "final.json", runs[2] / "final.json")  # another run's result
    (runs[4] / "checkpoint.pt").write_bytes(b"")  # a 0-byte checkpoint beside a whole final.json
    return {r.name: {p.name: sha(p) for p in r.iterdir() if p.is_file()} for r in runs[:3] + runs[4:5]}


def test_damaged_runs_are_counted_listed_and_retrained_with_their_files_kept(grid, cli):
    folder, ex = grid
    damaged = damage(ex)
    st = grid_status(ex)
    assert st.counts == {"finished": 2, "running": 0, "failed": 0, "damaged": 4, "pending": 0}
    text = status_text(st)
    assert "6 runs in" in text and "2 finished" in text and "4 damaged" in text
    assert "does not parse" in text and "holds a list" in text and "not run" in text and "empty (0 bytes)" in text
    r = cli("bench", "grid", "grid.toml", "--status", "--out", "runs", cwd=folder)
    assert r.returncode == 0 and "2 finished, 0 running, 0 failed, 4 damaged, 0 pending" in r.stdout, r.stdout

    # the report: the header, the tables and the problems say the same
    rep = collect(ex)
    assert rep.counts() == {"finished": 2, "damaged": 4}
    md = markdown(rep)
    assert "6 runs: 2 finished, 4 damaged." in md
    assert sum(c.n for c in rep.cells.values()) == 2
    problems = md.split("## Problems")[1]
    assert all(key in problems for key in damaged) and problems.count("damaged, not counted") == 4
    r = cli("bench", "report", "runs", cwd=folder)
    assert r.returncode == 0 and "6 runs: 2 finished, 4 damaged." in r.stdout

    # a rerun sets the damaged files aside (byte for byte) and trains those runs
    todo = prepare_runs(ex)
    assert sorted(c.key for c in todo) == sorted(damaged)
    for cell in todo:
        assert run_task(ex.run_dir(cell), threads=1).state == "finished"
    assert grid_status(ex).counts["finished"] == 6 and collect(ex).counts() == {"finished": 6}
    for key, was in damaged.items():
        run = ex.run_dir(key)
        aside = [p for p in run.iterdir() if p.is_dir() and p.name.startswith("damaged-")]
        assert len(aside) == 1, key
        kept = {p.name: sha(p) for p in aside[0].iterdir() if p.name != "why.txt"}
        assert kept and all(was[name] == digest for name, digest in kept.items()), key
        assert "damaged" in (run / "log.txt").read_text() and str(aside[0]) in (run / "log.txt").read_text()
        assert RunDir(run).damage() is None and RunDir(run).state == "finished"
    # whole final.json with a good checkpoint is resumed from it, not trained again
    assert set(os.listdir(next(p for p in ex.run_dir(list(damaged)[0]).iterdir() if p.is_dir()))) == {
        "final.json", "why.txt"}


def test_a_zero_byte_checkpoint_is_set_aside_and_the_run_starts_afresh(tmp_path, cli):
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128", "--depth", "1",  # one block
            "--out", tmp_path / "D"]
    assert cli(*args).returncode == 0
    for name in ("final.json", "best.pt"):
        (tmp_path / "D" / name).unlink()
    (tmp_path / "D" / "checkpoint.pt").write_bytes(b"")
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "was damaged" in r.stderr and "checkpoint.pt" in r.stderr and "training it afresh" in r.stderr
    aside = [p for p in (tmp_path / "D").iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint.pt").stat().st_size == 0
    assert "empty" in (aside[0] / "why.txt").read_text()
    assert RunDir(tmp_path / "D").state == "finished"


def test_a_checkpoint_that_would_run_code_is_refused_unrun_and_set_aside(tmp_path, cli):
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128", "--depth", "1",  # one block
            "--out", tmp_path / "D"]
    assert cli(*args).returncode == 0

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"format": "structinit-train/1", "epoch": 1, "payload": Evil()}, tmp_path / "D" / "checkpoint.pt")
    assert "would run code (posix.system)" in RunDir(tmp_path / "D").damage()
    r = cli(*args, "--resume")
    assert r.returncode == 0 and "would run code" in r.stderr, r.stderr
    assert not (tmp_path / "pwned").exists()


def test_a_pickle_that_carries_code_is_named_as_refused_not_as_truncated(tmp_path, cli):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    # protocol 4: torch's weights-only reader stops at its first opcode, before the code
    (tmp_path / "evil4.pth").write_bytes(pickle.dumps({"state_dict": {}, "x": Evil()}, protocol=4))
    for args in (["apply", "evil4.pth", "--heads", "4"], ["inspect", "evil4.pth"]):
        line = one_error(cli(*args, cwd=tmp_path), 1, "asks to run code", "posix.system", "nothing of it was run")
        assert "truncated" not in line
    (tmp_path / "D").mkdir()
    shutil.copy(tmp_path / "evil4.pth", tmp_path / "D" / "checkpoint.pt")
    from structinit.errors import StructinitError
    from structinit.training.rundir import load_train_checkpoint

    with pytest.raises(StructinitError, match=r"would run code \(posix.system\)"):
        load_train_checkpoint(tmp_path / "D" / "checkpoint.pt")
    assert not (tmp_path / "pwned").exists()


def test_resume_with_other_settings_names_them_as_options_not_python_dicts(tmp_path, cli):
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128", "--depth", "1", "--init",
            "impulse", "-p", "data_fit=0", "--out", tmp_path / "D"]
    assert cli(*args).returncode == 0
    line = one_error(cli(*args[:-2], "-p", "filter=5", "--out", tmp_path / "D", "--resume"), 2)
    assert "init_params.filter 3 in the run, 5 now" in line and "{" not in line and "'" not in line


# --------------------------------------------------------------------------- grid manifests

def test_a_damaged_manifest_is_written_anew_and_never_breaks_another_grids_report(grid, cli):
    folder, ex = grid
    other = folder / "other.toml"
    other.write_text(variant(GRID, name="other", seeds=1))
    r = cli("bench", "grid", "other.toml", "--out", "runs", cwd=folder)  # its runs are the tiny grid's seed 0
    assert r.returncode == 0 and "nothing to launch" in r.stdout, r.stderr
    manifest = ex.manifest_path
    manifest.write_text(manifest.read_text()[:100])  # cut short
    r = cli("bench", "report", "runs", "--grid", "other", cwd=folder)
    assert r.returncode == 0 and "# Tiny digits grid" in r.stdout and "2 runs: 2 finished" in r.stdout, r.stderr
    r = cli("bench", "report", "runs", cwd=folder)
    assert r.returncode == 0 and r.stderr.count("warning: ") == 1 and "left out" in r.stderr
    one_error(cli("bench", "report", "runs", "--grid", "tiny", cwd=folder), 2, "not a readable grid manifest",
              "again")
    # the grid's own command repairs it, keeping the damaged file aside
    r = cli("bench", "grid", "grid.toml", "--out", "runs", cwd=folder)
    assert r.returncode == 0 and "warning: the grid manifest" in r.stderr and "written again" in r.stderr
    assert json.loads(manifest.read_text())["name"] == "tiny"
    assert len(list(manifest.parent.glob(manifest.name + ".damaged-*"))) == 1
    r = cli("bench", "report", "runs", cwd=folder)
    assert r.returncode == 0 and "warning" not in r.stderr and r.stdout.count("6 runs: 6 finished") == 1
    assert len(reports_for_folder(folder / "runs")) == 2


def test_file_system_errors_of_bench_grid_exit_1(grid, cli):
    folder, ex = grid
    (folder / "fresh").mkdir()
    (folder / "fresh" / "grids").write_text("a file where the manifests' folder goes")
    one_error(cli("bench", "grid", "grid.toml", "--out", "fresh", "--launcher", "print", cwd=folder), 1,
              "cannot write")


def test_a_final_json_beside_a_checkpoint_of_an_earlier_epoch_is_damaged_not_finished(tmp_path):
    """A run killed between saving epoch 1 of 2 and a stale final.json of the whole run written
    beside it: the checkpoint does not hold the epochs final.json reports, so the run is damaged."""
    from structinit.training.config import TrainConfig
    from structinit.training.loop import train

    out = tmp_path / "run"
    train(TrainConfig(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, train_size=64,
                      batch_size=32, epochs=2, init="mimetic", threads=1, out=str(out)))
    run = RunDir(out)
    assert run.state == "finished"
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    ck["epoch"] = 1
    torch.save(ck, out / "checkpoint.pt")
    assert run.state == "damaged"
    assert run.damage() == (f"{out / 'final.json'} reports 2 epoch(s) and {out / 'checkpoint.pt'} holds epoch 1, "
                            "of 2")


def test_the_run_lock_is_reentrant_and_held_while_train_writes_final_json(tmp_path, monkeypatch):
    """bench run's task holds a run's lock while its own call to train takes it again: the inner
    release keeps it held. And train holds it while it writes final.json, so no other process can
    take the folder while the run's result is being written."""
    from filelock import FileLock, Timeout

    from structinit.training.config import TrainConfig
    from structinit.training.loop import train

    def taken_elsewhere(folder):
        other = FileLock(str(folder / ".lock"), timeout=0, thread_local=False)
        try:
            other.acquire()
        except Timeout:
            return True
        other.release()
        return False

    run = RunDir(tmp_path / "r")
    run.lock()
    run.lock()
    run.unlock()
    assert run.locked() and taken_elsewhere(tmp_path / "r")
    run.unlock()
    assert not run.locked() and not (tmp_path / "r" / ".lock").exists()

    seen = []
    write_final = RunDir.write_final

    def watched(self, summary):
        seen.append((self.locked(), taken_elsewhere(self.path)))
        write_final(self, summary)

    monkeypatch.setattr(RunDir, "write_final", watched)
    train(TrainConfig(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, train_size=64,
                      batch_size=32, epochs=1, init="mimetic", threads=1, out=str(tmp_path / "t")))
    assert seen == [(True, True)]
