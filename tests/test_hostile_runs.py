"""Hostile input to run folders and paths (round 6): a user's file in a folder given to
``train --resume``, FIFOs at every name a run folder holds, path components over the file-name
limit and legal long names, loops of symbolic links, one exit-code rule for every path a command
is given, a task killed outright, a garbage ``config.json``, the order of fsync and rename, and
fast checks of what only slow tests reached (timm's ``arch`` hint, torchrun's rank 0 writing for the
task that holds the run's lock, the early stop handler, torchrun's report after a stop). Real
files, real FIFOs, real processes where a lock must be held by another one."""

import errno
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from conftest import digest, error_line, hold_lock
from grids import TINY_GRID, expand_text, trained_grid, variant

from structinit import atomic
from structinit.experiments.launch import prepare_runs
from structinit.experiments.status import run_status
from structinit.experiments.task import read_run_config
from structinit.training.rundir import LOCK_HELD_ENV, RunDir

REPO = Path(__file__).resolve().parents[1]
#: One tiny run: a grid of one cell.
ONE = variant(TINY_GRID, name="one", seeds=1, train_size=64, epochs=1,
              axes='[[axes.init]]\nid = "mimetic"\ninit = "mimetic"\ninit_params = { base = "pytorch" }\n')
TRAIN = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128", "--depth", "1"]
HANG_BOUND = 60.0
LONG = "a" * 300  # one path component over the 255 bytes a file name may have


def one_error(r, code, *needles):
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    line = error_line(r.stderr)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# --------------------------------------------------------------------------- 1: train --resume and a user's file

def test_resume_in_a_folder_of_a_users_files_keeps_them_byte_for_byte(tmp_path, cli):
    out = tmp_path / "d"
    out.mkdir()
    (out / "metrics.jsonl").write_text("my metrics\n")
    (out / "best.pt").write_bytes(b"my weights")
    before = {n: digest(out / n) for n in ("metrics.jsonl", "best.pt")}
    r = cli(*TRAIN, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert "was damaged" in r.stderr and "no checkpoint.pt" in r.stderr
    aside = [p for p in out.iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1
    assert {n: digest(aside[0] / n) for n in before} == before
    assert "no checkpoint.pt" in (aside[0] / "why.txt").read_text()
    assert RunDir(out).state == "finished"


# --------------------------------------------------------------------------- 9: FIFOs in a run folder

@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """The one-run grid, trained, in a folder the tests copy before they put a FIFO in it."""
    root = tmp_path_factory.mktemp("fifo")
    trained_grid(root, ONE)
    return root


def release(folder: Path) -> None:
    """Open the other end of every FIFO under ``folder`` (without blocking) and close it: a reader
    waiting in its open sees the end of the file, a writer waiting in its open gets a broken pipe."""
    for p in folder.rglob("*"):
        if p.is_fifo():
            for how in (os.O_WRONLY, os.O_RDONLY):
                try:
                    os.close(os.open(p, how | os.O_NONBLOCK))
                except OSError:
                    pass


def bounded(folder: Path, call):
    """``call()`` in this thread with a watchdog that frees every FIFO under ``folder`` after
    :data:`HANG_BOUND` seconds; fails if the call waited on one that long."""
    hung, done = threading.Event(), threading.Event()

    def watchdog():
        if done.wait(HANG_BOUND):
            return
        hung.set()
        while not done.is_set():  # until the call returns: it may open a FIFO again
            release(folder)
            done.wait(0.05)

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        result = call()
    finally:
        done.set()
        guard.join()
    assert not hung.is_set(), f"waited {HANG_BOUND:.0f} s on a FIFO"
    return result


@pytest.mark.parametrize("name", [RunDir.CONFIG, RunDir.METRICS, RunDir.FINAL, RunDir.TASK, RunDir.LOG,
                                  RunDir.CHECKPOINT, RunDir.BEST, RunDir.HEARTBEAT])
def test_a_fifo_at_any_name_of_a_run_folder_is_never_waited_on(one_run, tmp_path, cli, name):
    folder = tmp_path / "g"
    shutil.copytree(one_run, folder)
    run = next(p for p in (folder / "runs").iterdir() if p.is_dir() and p.name != "grids")
    (run / name).unlink()
    os.mkfifo(run / name)
    if name != RunDir.FINAL:  # the rerun has work to do (and a log to write): final.json again, from the checkpoint
        (run / RunDir.FINAL).unlink()
    status = bounded(folder, lambda: cli("bench", "grid", "grid.toml", "--out", "runs", "--status", cwd=folder))
    assert status.returncode == 0 and "1 run in" in status.stdout, status.stderr
    report = bounded(folder, lambda: cli("bench", "report", "runs", cwd=folder))
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    again = bounded(folder, lambda: cli("bench", "grid", "grid.toml", "--out", "runs", "--launcher", "print",
                                        cwd=folder))
    assert again.returncode == 0, again.stderr
    rerun = bounded(folder, lambda: cli("bench", "run", run, "--threads", "1", cwd=folder))
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr
    assert bounded(folder, lambda: RunDir(run).state) == "finished"
    kept = [p for p in run.rglob(name + "*") if p.is_fifo()]
    assert len(kept) <= 1  # replaced by the run's own file, or kept (aside or in place); never read


def test_appending_to_a_fifo_or_a_folder_is_refused_not_waited_on(tmp_path):
    def appends():
        os.mkfifo(tmp_path / "log.txt")
        with pytest.raises(atomic.NotRegularFile, match="FIFO"):
            atomic.append_line(tmp_path / "log.txt", "a line")
        with open(os.open(tmp_path / "log.txt", os.O_RDONLY | os.O_NONBLOCK), "rb") as reader:  # a reader is there
            with pytest.raises(atomic.NotRegularFile, match="FIFO"):
                atomic.append_line(tmp_path / "log.txt", "a line")
            assert reader.read() in (b"", None)  # nothing was written into it
        (tmp_path / "dir").mkdir()
        with pytest.raises(OSError):
            atomic.append_line(tmp_path / "dir", "a line")
        atomic.append_line(tmp_path / "plain.txt", "one")
        atomic.append_line(tmp_path / "plain.txt", "two")
        assert (tmp_path / "plain.txt").read_text() == "one\ntwo\n"

    bounded(tmp_path, appends)


def test_a_log_that_cannot_be_written_is_said_once_per_folder(tmp_path):
    from structinit.errors import StructinitWarning

    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    os.mkfifo(run.file(run.LOG))

    def logs():
        with pytest.warns(StructinitWarning) as said:
            for n in range(3):
                run.append_log(f"line {n}")
        lines = [str(w.message) for w in said if issubclass(w.category, StructinitWarning)]
        assert len(lines) == 1 and str(run.file(run.LOG)) in lines[0] and "FIFO" in lines[0]
        assert "not kept" in lines[0]
        plain = RunDir(tmp_path / "p")
        plain.path.mkdir()
        plain.append_log("kept")  # a writable log warns nothing
        assert plain.file(plain.LOG).read_text() == "kept\n"

    bounded(run.path, logs)


def test_a_run_folders_readers_refuse_a_fifo(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    for name in (run.METRICS, run.LOG, run.TASK, run.FINAL):
        os.mkfifo(run.file(name))

    def reads():
        assert run.epochs_recorded() == 0 and run.last_log_line() is None and run.read_task() is None
        assert run.read_metrics(strict=False) == [] and run.peek_json(run.FINAL) is None
        with pytest.raises(OSError):
            run.read_metrics()
        os.mkfifo(run.file(run.CONFIG))
        with pytest.raises(Exception, match="FIFO"):
            run.read_config()
        assert run.damage() == "final.json, metrics.jsonl: not a regular file"

    bounded(run.path, reads)


# --------------------------------------------------------------------------- 10: long names

def test_a_temp_name_always_fits_and_a_name_too_long_is_refused_before_writing(tmp_path):
    for n in (243, 250, 255):
        path = tmp_path / ("b" * n)
        atomic.write_text(path, "x")
        assert path.read_text() == "x"
        with atomic.atomic_path(tmp_path / ("c" * (n - 8) + ".json.gz")) as tmp:
            assert len(tmp.name.encode()) <= 255 and tmp.name.endswith(".json.gz")
            tmp.write_bytes(b"gz")
    with pytest.raises(OSError) as got:
        atomic.write_text(tmp_path / ("d" * 256), "x")
    assert got.value.errno == errno.ENAMETOOLONG and "256 bytes" in got.value.strerror
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["b"] * 3 + ["c"] * 3  # no temp file left
    assert len(atomic.temp_name(tmp_path / ("é" * 127)).name.encode()) <= 255  # cut at a character


@pytest.mark.parametrize("args", [
    ["apply", "ck.pt", "--heads", "2", "--out", LONG],
    ["apply", "ck.pt", "--heads", "2", "--data", LONG],
    ["train", "--out", LONG],
    ["inspect", LONG],
    ["inspect", "art.safetensors", "--png", f"x/{LONG}.png"],
    ["bench", "grid", "digits", "--out", LONG, "--status"],
    ["solve", "--cache-dir", f"{LONG}/c"],
], ids=["apply-out", "apply-data", "train-out", "inspect", "inspect-png", "grid-out", "solve-cache"])
def test_a_path_component_over_the_limit_is_one_line_and_exit_2_before_any_work(tmp_path, cli, args):
    r = cli(*args, cwd=tmp_path)
    one_error(r, 2, "bytes, longer than the 255 a file name may have")
    assert os.listdir(tmp_path) == []  # refused up front: no model built, no cache made, nothing written


def test_a_legal_long_png_name_is_written(tmp_path, cli):
    from structinit import SolveConfig, solve

    art = solve(SolveConfig(grid=(4, 4), dim=16, heads=2, filter=3)).artifact
    png = tmp_path / ("p" * 251 + ".png")
    r = cli("inspect", art.path, "--png", png)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- 11: symlink loops

@pytest.mark.parametrize("args", [
    ["apply", "ck.pt", "--heads", "2", "--out", "loop"],
    ["apply", "ck.pt", "--heads", "2", "--data", "loop"],
    ["train", "--out", "loop"],
    ["inspect", "loop"],
    ["bench", "run", "loop"],
    ["solve", "--cache-dir", "loop"],
], ids=["apply-out", "apply-data", "train-out", "inspect", "bench-run", "solve-cache"])
def test_a_loop_of_symbolic_links_is_one_line_and_exit_2(tmp_path, cli, args):
    os.symlink("loop", tmp_path / "loop")
    one_error(cli(*args, cwd=tmp_path), 2, "loop", "symbolic links")


def test_a_run_folder_that_no_folder_can_be_is_refused_by_the_library_too(tmp_path):
    from structinit.errors import UsageError

    os.symlink("loop", tmp_path / "loop")
    for path, why in ((tmp_path / "loop", "symbolic links"), (tmp_path / LONG, "File name too long")):
        with pytest.raises(UsageError, match=why):
            RunDir(path)


def test_a_looping_cache_entry_is_set_aside_like_a_damaged_one(tmp_path, cli, cache_dir):
    from structinit.solver.config import SolveConfig

    cfg = SolveConfig(grid=(4, 4), dim=16, heads=2, filter=3)
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(cfg.filename, cache_dir / cfg.filename)
    r = cli("solve", "--tokens", "16", "--dim", "16", "--heads", "2", "--filter", "3")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "loop of symbolic links" in r.stderr
    aside = [p for p in cache_dir.iterdir() if p.name.startswith(cfg.filename + ".set-aside")]
    assert len(aside) == 1 and aside[0].is_symlink()
    assert (cache_dir / cfg.filename).is_file() and not (cache_dir / cfg.filename).is_symlink()


# --------------------------------------------------------------------------- 16: one exit-code rule for paths

def _kinds(folder: Path) -> dict:
    """A path of each kind that names nothing usable as a file: missing, a link to nothing, a loop,
    a folder, a FIFO."""
    os.symlink("nowhere", folder / "dangling")
    os.symlink("loop", folder / "loop")
    (folder / "adir").mkdir()
    os.mkfifo(folder / "fifo")
    return {"missing": "missing", "dangling": "dangling", "loop": "loop", "folder": "adir", "fifo": "fifo"}


@pytest.mark.parametrize("kind", ["missing", "dangling", "loop", "folder", "fifo"])
@pytest.mark.parametrize("command", [["inspect", "{}"], ["apply", "{}", "--heads", "2"], ["bench", "run", "{}"],
                                     ["inspect", "{}.safetensors"]],
                         ids=["inspect", "apply", "bench-run", "inspect-artifact"])
def test_every_path_that_names_no_usable_file_exits_2(tmp_path, cli, kind, command):
    names = _kinds(tmp_path)
    if command[-1] == "{}.safetensors":
        for name in names.values():
            if os.path.lexists(tmp_path / name):
                os.rename(tmp_path / name, tmp_path / f"{name}.safetensors")
    args = [a.format(names[kind]) for a in command]
    if command[:2] == ["bench", "run"] and kind == "folder":
        one_error(cli(*args, cwd=tmp_path), 2, "config.json")  # a folder, but not a run's
        return
    one_error(cli(*args, cwd=tmp_path), 2, names[kind])


@pytest.mark.parametrize("kind", ["dangling", "fifo", "file"])
@pytest.mark.parametrize("command", [["train", "--out", "{}"], ["solve", "--cache-dir", "{}"]],
                         ids=["train-out", "solve-cache-dir"])
def test_every_folder_path_that_names_no_usable_folder_exits_2(tmp_path, cli, kind, command):
    names = dict(_kinds(tmp_path), file="file.txt")
    (tmp_path / "file.txt").write_text("mine")
    args = [a.format(names[kind]) for a in command]
    one_error(cli(*args, cwd=tmp_path), 2, names[kind])
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_the_readme_states_the_rule():
    text = " ".join((REPO / "README.md").read_text().split())
    assert ("a path that names nothing usable as asked: a missing file, a symbolic link to nothing or a loop of "
            "links, a name longer than the file system allows, a folder given for a file (or a file for a folder), "
            "a FIFO or a device") in text


# --------------------------------------------------------------------------- 18: a task killed outright

def test_a_task_killed_outright_is_not_running_once_its_lock_is_free(tmp_path):
    ex = expand_text(ONE, tmp_path / "runs")
    cell = prepare_runs(ex)[0]
    run = ex.run_dir(cell)
    rd = RunDir(run)
    holder = hold_lock(run)
    try:
        rd.write_task({"state": "running", "host": "here"})
        rd.touch_heartbeat()
        assert rd.lock_held() is True
        assert run_status(run).state == "running"
        assert prepare_runs(ex) == []  # a live task's run is left to it
    finally:
        holder.kill()  # SIGKILL: no handler runs, task.json still says running, the heartbeat is fresh
        holder.wait()
    assert (run / ".lock").exists() and rd.lock_held() is False
    st = run_status(run)
    assert st.state == "pending", st
    assert [c.key for c in prepare_runs(ex)] == [cell.key]  # launched again at once, not in 2 minutes


def test_a_soft_lock_that_cannot_be_probed_falls_back_on_the_heartbeat(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    assert run.lock_held() is False  # no .lock: nobody holds it
    run.lock()
    try:
        assert run.lock_held() is True
    finally:
        run.unlock()
    assert run.lock_held() is False


# --------------------------------------------------------------------------- 19: a garbage config.json

@pytest.mark.parametrize("garbage", [b"\x00\xffnot json", b"[1, 2]", b'{"config": {"model": 5}}'],
                         ids=["bytes", "a-list", "no-settings"])
def test_a_garbage_config_json_is_set_aside_and_written_again_from_the_grid(tmp_path, cli, garbage):
    (tmp_path / "one.toml").write_text(ONE)
    assert cli("bench", "grid", "one.toml", "--launcher", "print", cwd=tmp_path).returncode == 0
    run = next(p for p in (tmp_path / "runs").iterdir() if p.name != "grids")
    (run / "config.json").write_bytes(garbage)
    r = cli("bench", "run", run, cwd=tmp_path)
    one_error(r, 1, "config.json", "structinit bench grid GRID.toml")
    r = cli("bench", "grid", "one.toml", "--launcher", "print", cwd=tmp_path)
    assert r.returncode == 0 and "written again from the grid" in r.stderr, r.stderr
    aside = [p for p in run.iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1 and (aside[0] / "config.json").read_bytes() == garbage
    assert read_run_config(run).key == run.name


# --------------------------------------------------------------------------- 23: fsync before the rename

def test_every_atomic_write_fsyncs_its_temp_file_before_moving_it_into_place(tmp_path, monkeypatch):
    import torch

    events = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("move", os.path.basename(src)))
        return real_replace(src, dst, **kw)

    def link(src, dst, **kw):
        events.append(("move", os.path.basename(src)))
        return real_link(src, dst, **kw)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    monkeypatch.setattr(atomic.os, "link", link)
    atomic.write_text(tmp_path / "final.json", "{}")
    atomic.save_torch({"w": torch.zeros(2)}, tmp_path / "checkpoint.pt")
    with atomic.atomic_write(tmp_path / "art.safetensors", exclusive=True) as fh:
        fh.write(b"x")
    with atomic.atomic_path(tmp_path / "trace.json") as tmp:
        tmp.write_text("{}")
    moves = [i for i, e in enumerate(events) if e[0] == "move"]
    assert len(moves) == 4, events
    for i in moves:
        temp = events[i][1]
        assert ("fsync", temp) in events[:i], (temp, events)


# --------------------------------------------------------------------------- 24: what only slow tests reached

def test_a_timm_arch_hint_gives_the_heads_only_for_its_own_width(tmp_path):
    import torch
    from test_checkpoint_files import timm_training_checkpoint_sd

    from structinit.init.checkpoints import load_checkpoint

    sd = timm_training_checkpoint_sd()  # dim 192
    for arch, heads in (("vit_tiny_patch16_224", 3), ("vit_small_patch16_224", None), ("no_such_model", None)):
        torch.save({"state_dict": sd, "arch": arch}, tmp_path / "t.pth")
        ckpt = load_checkpoint(tmp_path / "t.pth")
        assert (ckpt.detected.heads, ckpt.extra.get("arch")) == (heads, arch if heads else None), arch


def test_torchruns_rank_0_writes_the_run_whose_lock_the_task_holds(tmp_path, monkeypatch):
    from structinit.experiments.task import torchrun_env
    from structinit.training.config import TrainConfig

    out = tmp_path / "run"
    env = torchrun_env(TrainConfig(out=str(out), threads=3), environ={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "3", LOCK_HELD_ENV: str(out.resolve())}
    out.mkdir()
    holder = hold_lock(out)  # the task, another process, holds it
    try:
        with pytest.raises(Exception, match="in use"):
            RunDir(out).lock()  # anyone else is refused
        monkeypatch.setenv(LOCK_HELD_ENV, env[LOCK_HELD_ENV])
        rd = RunDir(out)
        rd.lock()  # rank 0, told so, writes for the task
        assert rd.locked()
        rd.unlock()
        assert (out / ".lock").exists()  # the task's lock file is left to the task
    finally:
        holder.kill()
        holder.wait()


def test_the_structinit_script_installs_the_stop_handler_of_train_and_bench_as_it_starts(monkeypatch):
    from structinit import cli as cli_package
    from structinit.experiments import stopping

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(stopping, "_PROCESS_STOPPER", None)
    assert not cli_package.stop_early(["/usr/bin/structinit", "apply", "x.pt"])
    assert not cli_package.stop_early(["/usr/bin/pytest", "train"])
    assert signal.getsignal(signal.SIGTERM) == before and stopping._PROCESS_STOPPER is None
    try:
        assert cli_package.stop_early(["/venv/bin/structinit", "train", "--epochs", "1"])
        stopper = stopping._PROCESS_STOPPER
        assert stopper is not None and signal.getsignal(signal.SIGTERM) == stopper._on_signal
    finally:
        if stopping._PROCESS_STOPPER is not None:
            stopping._PROCESS_STOPPER.restore()
    assert signal.getsignal(signal.SIGTERM) == before


REPORT = """\
error: interrupted (SIGTERM); the checkpoint of epoch 2 is kept in runs/x
E1129 01:46:32.246000 12790 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 143) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
""".splitlines()


@pytest.mark.parametrize("stopped", [True, False])
def test_torchruns_report_is_left_out_after_a_stop_and_shown_after_a_failure(stopped):
    from structinit.experiments.task import TorchrunLog

    lines = []
    out = TorchrunLog(lines.append, lambda: True)
    for line in REPORT:
        out(line + "\n")
    assert lines == REPORT[:1]
    out.finish(stopped, 1)
    if stopped:
        assert lines[1:] == ["torchrun exited with code 1 after its processes stopped as asked (5 lines of its "
                             "failure report left out)"]
    else:
        assert lines == REPORT
    quiet = []
    before_stop = TorchrunLog(quiet.append, lambda: False)  # no stop asked: everything is shown as it comes
    for line in REPORT:
        before_stop(line)
    assert quiet == REPORT
