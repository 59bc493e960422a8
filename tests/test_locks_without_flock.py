"""The cache's key lock and a run folder's lock where the file system does not support ``flock``
(Lustre mounted without it, some NFS setups: ``flock`` fails with ENOSYS), as filelock >= 4.1
handles it: a soft lock (a file naming its owner) that still keeps a second process out, and that
the next process takes over once its owner was killed. The file system is simulated by
``fcntl.flock`` raising ENOSYS, in this process and in the holder's."""

import errno
import fcntl
import os
import signal
import subprocess
import sys
import warnings

import pytest
from conftest import vit_digits

from structinit.errors import StructinitError
from structinit.init.initialize import initialize_model
from structinit.solver.cache import key_lock
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve
from structinit.training.rundir import RunBusy, RunDir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CFG = SolveConfig(grid=(4, 4), dim=16, heads=2)
FALLBACK = "flock not supported on this filesystem, falling back to SoftFileLock"

#: A process that takes a lock with flock failing as here, says "held", and holds it until its stdin closes.
HOLDER = """
import errno, fcntl, sys, warnings
from pathlib import Path

def no_flock(*args):
    raise OSError(errno.ENOSYS, "Function not implemented")

fcntl.flock = no_flock
warnings.simplefilter("ignore")
kind, where = sys.argv[1], Path(sys.argv[2])
if kind == "cache":
    from structinit.solver.cache import key_lock

    with key_lock(where, sys.argv[3]):
        print("held", flush=True)
        sys.stdin.read()
else:
    from structinit.training.rundir import RunDir

    run = RunDir(where)
    run.lock()
    print("held", flush=True)
    sys.stdin.read()
    run.unlock()
"""


@pytest.fixture
def no_flock(monkeypatch):
    def refuse(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", refuse)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FALLBACK)  # filelock says it once per folder
        yield


def holder(*args):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held", proc.communicate()
    return proc


def test_a_solve_and_a_fit_run_where_flock_is_not_supported(no_flock, cache_dir):
    first = solve(CFG, cache_dir=cache_dir)
    assert not first.cached and first.artifact.path.is_file()
    assert solve(CFG, cache_dir=cache_dir).cached
    rep = initialize_model(vit_digits(), "impulse", data_fit=2, data_fit_samples=16, filter=5)
    assert rep["data_fit"]["artifact"]["cached"] is False
    assert not list((cache_dir / ".locks").iterdir())  # each soft lock is gone with its release


@pytest.mark.slow  # a second process holds the lock
def test_the_cache_lock_keeps_a_second_process_out_and_outlives_a_killed_holder(no_flock, tmp_path):
    name = CFG.filename
    proc = holder("cache", tmp_path, name)
    try:
        with pytest.raises(StructinitError, match=f"waited 1 s for another process solving {name}"):
            with key_lock(tmp_path, name, timeout=1):
                pass
        waits = []
        os.kill(proc.pid, signal.SIGKILL)  # its lock file stays, naming a process that is gone
        proc.wait()
        assert (tmp_path / ".locks" / f"{name}.lock").exists()
        with key_lock(tmp_path, name, timeout=60, wait=waits.append):
            assert (tmp_path / ".locks" / f"{name}.lock").exists()
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / ".locks" / f"{name}.lock").exists()


@pytest.mark.slow  # a second process holds the lock
def test_a_run_folders_lock_keeps_a_second_process_out_and_outlives_a_killed_holder(no_flock, tmp_path):
    folder = tmp_path / "run"
    proc = holder("run", folder)
    try:
        with pytest.raises(RunBusy, match=f"run folder {folder} is in use"):
            RunDir(folder).lock()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert (folder / ".lock").exists()
        run = RunDir(folder)
        run.lock()  # at once: a killed owner's soft lock is taken over, never a "folder in use" for nobody
        run.unlock()
    finally:
        proc.kill()
        proc.wait()
    assert not (folder / ".lock").exists()
    proc = holder("run", folder)  # and a live holder's lets go when it is done
    proc.stdin.close()
    assert proc.wait() == 0 and not (folder / ".lock").exists()
    run = RunDir(folder)
    run.lock()
    run.unlock()
