"""A task's run under ``torchrun`` (``nproc > 1``): its environment, the training processes
started with the stop signals blocked and sent SIGTERM when the task stops, and torchrun's own
output folded into the run's log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from structinit.errors import UsageError, param
from structinit.experiments.commands import shell_command, train_command
from structinit.experiments.stopping import STOP_SIGNALS, Stopper, restore_mask, signal_mask


def torchrun_env(config, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of the ``torchrun`` a task starts for ``config`` (a ``TrainConfig``):
    ``environ`` (default this process's) with one CPU thread per process unless ``config.threads``
    says otherwise, and :data:`~structinit.training.rundir.LOCK_HELD_ENV` naming the run folder,
    whose lock this task holds, so that torchrun's rank 0 writes the run for it instead of being
    refused as a second writer."""
    from structinit.training.rundir import LOCK_HELD_ENV

    return dict(os.environ if environ is None else environ, OMP_NUM_THREADS=str(config.threads or 1),
                **{LOCK_HELD_ENV: str(Path(config.out).expanduser().resolve())})


def train_torchrun(config, nproc: int, stopper: Stopper, log) -> tuple:
    """Train under ``torchrun``, started with SIGTERM and SIGUSR2 blocked (a child keeps the signal
    mask of the thread that starts it, across exec), which its processes inherit: torchrun's agent
    never acts on them (on SIGTERM it would signal its processes and, on a second one, such as a
    scheduler's beside this task's, give up waiting for them and leave them running), and the
    training processes unblock SIGTERM alone once its handler is in place, so one sent while they
    start waits for it. A stop request is sent as SIGTERM to the training processes themselves
    (the agent's children, started in sessions of their own); they stop together after one step
    (:func:`structinit.training.loop.train`'s ``stop``) and the agent ends after them. This task
    decides what SIGUSR2 means (stop and requeue). A process still running 60 s after the stop
    request is killed."""
    from structinit.training.rundir import RunDir

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "structinit"] + train_command(config, program=[])
    log("torchrun: " + shell_command(cmd))
    env = torchrun_env(config)
    # Without /proc (not Linux) this task cannot find the training processes: torchrun's agent then
    # takes SIGTERM and passes it on, as torchrun does by itself.
    linux = os.path.isdir("/proc/self")
    blocked = signal_mask("SIG_BLOCK", STOP_SIGNALS if linux else STOP_SIGNALS[1:])
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    finally:
        restore_mask(blocked)

    out = proc.stdout
    assert out is not None  # stdout=PIPE

    lines = TorchrunLog(log, stopper.event.is_set)

    def pump():
        for line in out:
            lines(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    sent: Optional[float] = None
    told: set = set()  # the training processes sent SIGTERM
    while proc.poll() is None:
        try:
            if not stopper.event.wait(0.5):
                continue
            sent = sent or time.monotonic()
            if not linux and not told:
                _signal(-proc.pid, signal.SIGTERM)
                told.add(proc.pid)
            for pid in set(_children(proc.pid)) - told:  # started since the last look, too
                _signal(pid, signal.SIGTERM)
                told.add(pid)
            if time.monotonic() - sent > 60:
                for pid in _children(proc.pid):
                    _signal(pid, signal.SIGKILL)
                _signal(-proc.pid, signal.SIGKILL)
        except KeyboardInterrupt:  # Ctrl-C of this task (torchrun, in a session of its own, did not see it)
            stopper.request("interrupted")
    reader.join(timeout=5)
    rd = RunDir(config.out)
    lines.finish(rd.state == "finished" or stopper.event.is_set(), proc.returncode)
    if rd.state == "finished":  # whatever torchrun's exit code: a stop after the last epoch changes nothing
        return "finished", (rd.read_final() or {}).get("final_acc"), None
    if stopper.event.is_set():
        return "interrupted", None, None
    return "failed", None, f"torchrun exited with code {proc.returncode} (see {rd.file(rd.LOG)})"


#: The first line of torchrun's own report when its processes exit non-zero: its agent's log line
#: (``E1129 01:46:32.246000 12790 torch/distributed/elastic/...] failed (exitcode: 143)``) or the
#: traceback of the ``ChildFailedError`` (or ``SignalException``) it raises.
TORCHRUN_REPORT = re.compile(r"^([EWI]\d{4} [\d:.]+ +\d+ torch/distributed/elastic/"
                             r"|Traceback \(most recent call last\):)")


class TorchrunLog:
    """The output of a task's ``torchrun``, line by line, to ``log``; once ``stopping()`` (a stop was
    requested), torchrun's own failure report (from :data:`TORCHRUN_REPORT` on: a traceback about
    its processes' exit code, 40 lines) is held back, and :meth:`finish` shows it only when the run
    did not stop as asked (else one line says it was left out)."""

    def __init__(self, log: Callable[[str], None], stopping: Callable[[], bool]):
        self.log, self.stopping = log, stopping
        self.held: List[str] = []

    def __call__(self, line: str) -> None:
        line = line.rstrip()
        if self.held or (self.stopping() and TORCHRUN_REPORT.match(line)):
            self.held.append(line)
        else:
            self.log(line)

    def finish(self, stopped: bool, returncode: Optional[int]) -> None:
        """``stopped``: the run stopped as asked (or finished): the held report is noise."""
        if self.held and stopped:
            self.log(f"torchrun exited with code {returncode} after its processes stopped as asked "
                     f"({len(self.held)} lines of its failure report left out)")
        else:
            for line in self.held:
                self.log(line)
        self.held = []


def _children(pid: int) -> List[int]:
    """The processes whose parent is ``pid`` (from Linux's ``/proc``; none where there is none)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    kids = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            kids.append(int(name))
    return kids


def _signal(pid: int, sig: int) -> None:
    """``os.kill(pid, sig)`` (a negative ``pid``: its process group), for a process that may have ended."""
    try:
        if pid < 0:
            os.killpg(-pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def check_nproc(nproc: int) -> int:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UsageError(f"{param('nproc')} must be at least 1, got {nproc!r}")
    return nproc

