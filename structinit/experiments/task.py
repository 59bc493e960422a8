"""One run of a grid as a task: what a launcher starts (a local worker, a SLURM array task, or
``structinit bench run RUNS/<key>`` by hand).

A task reads the run's settings from ``RUNS/<key>/config.json`` (written when the grid was
launched), skips a finished run, takes the run's lock (a run is never trained by two tasks at
once), trains it with ``resume`` (a killed run continues from its checkpoint), and keeps these
files beside the run's own:

=================  ============================================================================
``task.json``      the task's state (``running``, ``finished``, ``failed``, ``interrupted``), where
                   and when it ran, the SLURM job, the error of a failed run
``log.txt``        every task's log lines, appended
``heartbeat``      touched every 30 s while a task runs (``bench grid --status`` reads its age)
``.lock``          the run's lock, held while a task (or ``structinit train``) writes the run
=================  ============================================================================

Stopping (submitit's conventions): ``SIGTERM`` (``scancel``, a requeue by the scheduler, Ctrl-C of
a local launcher) stops the task at the next optimizer step; the last epoch's checkpoint is on
disk, so nothing but the epoch in progress is lost. ``SIGUSR2`` (sent by SLURM before the time
limit with ``--signal=USR2@SECONDS``) does the same, finishing the epoch first when it fits in
the time left, and then asks SLURM to requeue the task (``scontrol requeue``), which resumes the
run when it starts again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from structinit.errors import StructinitError, UsageError, param

TASK_FILE, LOG_FILE, HEARTBEAT_FILE, LOCK_FILE = "task.json", "log.txt", "heartbeat", ".lock"
HEARTBEAT_EVERY = 30.0
#: Task states written to ``task.json``.
TASK_STATES = ("running", "finished", "failed", "interrupted")
#: TrainConfig fields that ``structinit train`` has no flag for (execution settings only).
NO_FLAG = ("eval_batch_size",)


class TaskInterrupted(Exception):
    """Raised inside training when the task was asked to stop."""


class Stopper:
    """A stop request shared by signal handlers and the training callbacks.

    :meth:`request` asks the task to stop; with ``requeue`` the task asks SLURM to requeue it once
    stopped. ``grace`` (seconds between the request and a hard kill, e.g. the ``--signal`` lead
    time) lets the epoch in progress finish when it is expected to fit.
    """

    def __init__(self, grace: Optional[float] = None):
        self.event = threading.Event()
        self.requeue = False
        self.reason: Optional[str] = None
        self.at: Optional[float] = None
        self.grace = grace
        self._epoch_start: Optional[float] = None
        self._epoch_first = 1

    def request(self, reason: str, requeue: bool = False) -> None:
        if not self.event.is_set():
            self.reason, self.at = reason, time.monotonic()
        self.requeue = self.requeue or requeue
        self.event.set()

    def install(self) -> None:
        """Handle SIGTERM (stop) and SIGUSR2 (stop and requeue) in this (main) thread until
        :meth:`restore`."""
        self._saved = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda s, f: self.request("SIGTERM")),
                       signal.SIGUSR2: signal.signal(signal.SIGUSR2, lambda s, f: self.request(
                           "SIGUSR2 (time limit or preemption)", requeue=True))}

    def restore(self) -> None:
        """Put back the signal handlers :meth:`install` replaced."""
        for sig, handler in getattr(self, "_saved", {}).items():
            signal.signal(sig, handler)
        self._saved = {}

    # ---- training callbacks
    def on_step(self, epoch: int, step: int, steps: int) -> None:
        now = time.monotonic()
        if step <= 1 or self._epoch_start is None:
            self._epoch_start, self._epoch_first = now, step
        if not self.event.is_set():
            return
        if self.requeue and self.grace:
            assert self.at is not None  # request() sets it before it sets the event
            done = step - self._epoch_first + 1
            per_step = (now - self._epoch_start) / max(done, 1)
            left = (steps - step) * per_step
            if done >= 3 and now - self.at + left < 0.8 * self.grace - 5:
                return  # the epoch will be checkpointed before the kill
        raise TaskInterrupted(self.reason)

    def on_init(self, done: int, total: int) -> None:
        """Called as the init's data fit takes its steps: a stop request ends the run there (the
        init wrote nothing yet, so a resumed run starts afresh)."""
        if self.event.is_set():
            raise TaskInterrupted(self.reason)

    def on_epoch(self, record: Dict[str, Any], epochs: int) -> None:
        self._epoch_start = None
        if self.event.is_set() and int(record["epoch"]) < epochs:
            raise TaskInterrupted(self.reason)


@dataclass
class TaskOutcome:
    """What :func:`run_task` did: ``state`` is ``finished``, ``already-finished``, ``busy`` (another
    task holds the run), ``failed`` or ``interrupted``. ``train_seconds``: time inside ``train``."""

    key: str
    path: str
    state: str
    seconds: float
    train_seconds: float = 0.0
    final_acc: Optional[float] = None
    error: Optional[str] = None
    requeued: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- run files

def read_run_config(run_dir: os.PathLike):
    """The :class:`~structinit.training.config.TrainConfig` of the run in ``run_dir`` (from its
    ``config.json``), checked against the run key the folder is named by."""
    from structinit.training.config import KEY_LENGTH, TrainConfig
    from structinit.training.rundir import RunDir

    rd = RunDir(run_dir)
    if not rd.path.is_dir():
        raise UsageError(f"run folder {rd.path} does not exist")
    doc = rd.read_config()
    if doc is None:
        raise UsageError(f"{rd.path} holds no config.json; launch the grid with structinit bench grid to create it")
    try:
        config = TrainConfig.from_dict(doc["config"])
        key = config.key
    except (KeyError, TypeError) as exc:
        raise StructinitError(f"{rd.file(rd.CONFIG)} is unreadable ({type(exc).__name__}: {exc})") from None
    name = rd.path.resolve().name
    looks_like_key = len(name) == KEY_LENGTH and all(ch in "0123456789abcdef" for ch in name)
    if looks_like_key and key != name:
        raise StructinitError(f"{rd.file(rd.CONFIG)} describes run {key}, not the run {name} its folder is named "
                              "by (was it edited?)")
    return config


def task_record(run_dir: os.PathLike) -> Optional[Dict[str, Any]]:
    """``task.json`` of a run (``None`` when there is none or it is unreadable)."""
    try:
        return json.loads((Path(run_dir) / TASK_FILE).read_text())
    except (OSError, ValueError):
        return None


def last_log_line(run_dir: os.PathLike, limit: int = 4096) -> Optional[str]:
    """The last non-empty line of the run's ``log.txt``."""
    path = Path(run_dir) / LOG_FILE
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _write_task(run_dir: Path, doc: Dict[str, Any]) -> None:
    from structinit.atomic import atomic_write

    with atomic_write(run_dir / TASK_FILE, "w") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")


def slurm_job() -> Optional[Dict[str, Any]]:
    """The SLURM job this process runs in (``None`` outside SLURM)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    env = os.environ
    return {"job_id": env.get("SLURM_JOB_ID"), "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": env.get("SLURM_ARRAY_TASK_ID"), "restart": int(env.get("SLURM_RESTART_COUNT", "0"))}


def slurm_requeue_target(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The name ``scontrol requeue`` takes for this job: ``ARRAYJOB_TASK`` for an array task (one
    task's own job id is the array's id, and ``scontrol`` reads that as every task of the array),
    else ``SLURM_JOB_ID``; ``None`` outside SLURM. ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    array, index = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and index:
        return f"{array}_{index}"
    return env.get("SLURM_JOB_ID") or None


def requeue_self(log: Callable[[str], None]) -> bool:
    """Ask SLURM to requeue this job, and only this task of an array (``scontrol requeue``
    :func:`slurm_requeue_target`); ``False`` if it cannot."""
    job = slurm_requeue_target()
    if not job:
        log("not under SLURM: cannot requeue; run the task again to resume")
        return False
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"scontrol requeue {job} failed: {exc}")
        return False
    if r.returncode != 0:
        log(f"scontrol requeue {job} failed: {(r.stderr or r.stdout).strip()}")
        return False
    log(f"requeued SLURM job {job}; the run resumes from its checkpoint when the task starts again")
    return True


# --------------------------------------------------------------------------- commands

def train_command(config, program: Optional[List[str]] = None) -> List[str]:
    """``structinit train`` arguments that train ``config`` (its ``out``, with ``--resume``):
    every setting that differs from TrainConfig's default, ``init_params`` as ``--init-param``.
    ``program`` replaces the leading ``["structinit"]`` (e.g. ``[python, "-m", "structinit"]``)."""
    from structinit.training.config import TrainConfig

    defaults = TrainConfig().to_dict()
    args = (list(program) if program is not None else ["structinit"]) + ["train"]
    for name, value in config.to_dict().items():
        if name in ("out", "resume") or name in NO_FLAG:
            continue
        always = name in ("model", "dataset")
        flag = "--" + name.replace("_", "-")
        if name == "init_params":
            for k, v in sorted(value.items()):
                args += ["--init-param", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
        elif isinstance(value, bool):
            if value:
                args.append(flag)
        elif value is not None and (always or value != defaults[name]):
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    if config.out:
        args += ["--out", str(config.out), "--resume"]
    return args


def shell_command(args: List[str]) -> str:
    return shlex.join(args)


# --------------------------------------------------------------------------- the task

class _Log:
    """Appends timestamped lines to ``log.txt`` and echoes them."""

    def __init__(self, path: Path, echo: Optional[Callable[[str], None]]):
        self.path, self.echo = path, echo

    def __call__(self, message: str) -> None:
        line = f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} {message}"
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass
        if self.echo:
            self.echo(line)


def _epoch_line(record: Dict[str, Any], epochs: int) -> str:
    text = f"epoch {record['epoch']}/{epochs}  loss {record['train_loss']:.4f}  train {record['train_acc']:.2f}%"
    for split in ("val", "test"):
        if f"{split}_acc" in record:
            text += f"  {split} {record[split + '_acc']:.2f}%"
    return text + f"  {record.get('epoch_seconds', 0):.1f}s"


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while True:
        try:
            path.touch()
        except OSError:
            pass
        if stop.wait(HEARTBEAT_EVERY):
            return


def run_task(run_dir: os.PathLike, *, threads: Optional[int] = None, device: Optional[str] = None, nproc: int = 1,
             stopper: Optional[Stopper] = None, echo: Optional[Callable[[str], None]] = None,
             launcher: str = "local", default_threads: Optional[int] = None) -> TaskOutcome:
    """Train the run in ``run_dir`` (see the module docstring) and say what happened.

    ``threads``/``device`` override the run's execution settings (they are not part of its key);
    ``default_threads`` applies when neither ``threads`` nor the run's settings choose. ``nproc >
    1`` trains under ``torchrun`` with that many processes. ``stopper`` is how the caller (or a
    signal) asks the task to stop. Errors of the run are caught and reported as ``failed`` (with
    the message in ``task.json`` and ``log.txt``); only a run folder that cannot be used at all
    raises.
    """
    from structinit.training.rundir import RunBusy, RunDir

    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    key = config.key
    rd = RunDir(run_dir)
    if rd.state == "finished":
        final = rd.read_final() or {}
        return TaskOutcome(key, str(run_dir), "already-finished", time.perf_counter() - t0,
                           final_acc=final.get("final_acc"))
    try:
        rd.lock()  # train() takes it again in this process; another process gets RunBusy
    except RunBusy:
        return TaskOutcome(key, str(run_dir), "busy", time.perf_counter() - t0)
    stopper = stopper or Stopper()
    log = _Log(run_dir / LOG_FILE, echo)
    beat_stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(run_dir / HEARTBEAT_FILE, beat_stop), daemon=True)
    record: Dict[str, Any] = {"state": "running", "key": key, "host": socket.gethostname(), "pid": os.getpid(),
                              "launcher": launcher, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                              "slurm": slurm_job(), "nproc": nproc}
    try:
        if rd.state == "finished":  # finished between the first look and the lock
            return TaskOutcome(key, str(run_dir), "already-finished", time.perf_counter() - t0)
        _write_task(run_dir, record)
        beat.start()
        config = dataclasses.replace(config, out=str(run_dir), resume=True)
        if threads is not None:
            config.threads = threads
        elif config.threads is None:
            config.threads = default_threads
        if device is not None:
            config.device = device
        where = f" (SLURM job {record['slurm']['job_id']})" if record["slurm"] else ""
        state = rd.state
        log(f"task start: run {key} on {record['host']}{where}"
            + (f", resuming after epoch {len(rd.read_metrics())}" if state == "resumable" else "")
            + (f"; it is damaged: {rd.damage()}" if state == "damaged" else ""))
        t_train = time.perf_counter()
        if nproc > 1:
            state, final_acc, error = _run_torchrun(config, nproc, stopper, log)
        else:
            state, final_acc, error = _run_here(config, stopper, log)
        train_seconds = time.perf_counter() - t_train
        requeued = False
        if state == "interrupted":
            done = len(rd.read_metrics()) if rd.state == "resumable" else 0
            log(f"task stopped ({stopper.reason}); " + (f"the checkpoint of epoch {done} is kept" if done else
                                                       "no epoch had finished: the next task starts the run afresh"))
            if stopper.requeue:
                requeued = requeue_self(log)
        elif state == "failed":
            log(f"error: {error}")
        else:
            log(f"task done: final accuracy {final_acc:.2f}%")
        record.update(state=state, ended=datetime.datetime.now().isoformat(timespec="seconds"),
                      train_seconds=round(train_seconds, 3), error=error, requeued=requeued)
        _write_task(run_dir, record)
        return TaskOutcome(key, str(run_dir), state, time.perf_counter() - t0, train_seconds, final_acc, error,
                           requeued)
    finally:
        beat_stop.set()
        rd.unlock()


def _run_here(config, stopper: Stopper, log) -> tuple:
    from structinit.training.loop import train

    epochs = int(config.hparams()["epochs"])

    def say_warning(message, category, filename, lineno, file=None, line=None):
        log(f"warning: {message}")  # one line in the run's log, not Python's two

    def on_epoch(record: Dict[str, Any]) -> None:
        log(_epoch_line(record, epochs))
        stopper.on_epoch(record, epochs)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = say_warning
            result = train(config, on_step=stopper.on_step, log=log, on_init=stopper.on_init, on_epoch=on_epoch)
    except TaskInterrupted:
        return "interrupted", None, None
    except KeyboardInterrupt:
        stopper.request("interrupted")
        return "interrupted", None, None
    except StructinitError as exc:
        return "failed", None, exc.render().splitlines()[0]
    except MemoryError:
        return "failed", None, "out of memory"
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the other runs go on
        return "failed", None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "finished", result.final_acc, None


def _run_torchrun(config, nproc: int, stopper: Stopper, log) -> tuple:
    from structinit.training.rundir import RunDir

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "structinit"] + train_command(config, program=[])
    log("torchrun: " + shell_command(cmd))
    from structinit.training.rundir import LOCK_HELD_ENV

    # this task holds the run's lock; torchrun's rank 0 writes the run for it
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads or 1),
               **{LOCK_HELD_ENV: str(Path(config.out).expanduser().resolve())})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    out = proc.stdout
    assert out is not None  # stdout=PIPE

    def pump():
        for line in out:
            log(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    sent = None
    while proc.poll() is None:
        if stopper.event.wait(0.5) and sent is None:
            sent = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
        if sent is not None and time.monotonic() - sent > 60:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    final = RunDir(config.out).read_final()
    if final is not None and proc.returncode == 0:
        return "finished", final.get("final_acc"), None
    if sent is not None:
        return "interrupted", None, None
    return "failed", None, f"torchrun exited with code {proc.returncode} (see {Path(config.out) / LOG_FILE})"


def check_nproc(nproc: int) -> int:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UsageError(f"{param('nproc')} must be at least 1, got {nproc!r}")
    return nproc


__all__ = ["run_task", "TaskOutcome", "Stopper", "TaskInterrupted", "read_run_config", "train_command",
           "task_record", "last_log_line", "requeue_self", "slurm_job", "slurm_requeue_target"]
