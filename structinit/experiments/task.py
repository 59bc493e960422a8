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

(written and read through :class:`~structinit.training.rundir.RunDir`, their one owner).

Stopping (submitit's conventions): ``SIGTERM`` (``scancel``, a requeue by the scheduler, Ctrl-C of
a local launcher) stops the task at the next optimizer step; the last epoch's checkpoint is on
disk, so nothing but the epoch in progress is lost. ``SIGUSR2`` (sent by SLURM before the time
limit with ``--signal=USR2@SECONDS``) does the same, finishing the epoch first when it fits in
the time left, and then asks SLURM to requeue the task (``scontrol requeue``), which resumes the
run when it starts again. ``task.json`` says ``interrupted`` before the task asks for the requeue.

Whatever the moment, a stopped task exits as a task that ran: ``structinit bench run`` installs its
handlers before it loads the command line (:func:`install_process_stopper`, from the entry point),
so a signal while it starts reports each run ``interrupted`` without writing anything to it (the
next task starts or resumes it), and it ignores both signals once its work is done and reported
(:meth:`Stopper.retire`), so that one arriving while Python shuts down (when Python has put the
default handlers back) cannot end it by the signal. Only a signal in the first instants, while
Python itself starts, ends the process by the signal (exit status 143); nothing is written then.
(``python -m structinit``, which the launchers run, installs the handler before loading the command
line; the ``structinit`` script just after.) A scheduler signals every process of the job: under
``torchrun`` (``nproc > 1``) torchrun and its processes start with both signals blocked, the task
decides and sends SIGTERM to the training processes, which stop together after one step
(:func:`structinit.training.loop.train`'s ``stop``); DataLoader workers leave both to the process
that trains; ``scontrol requeue`` runs with them blocked.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from structinit.errors import SYNTAX, StructinitError, Syntax, UsageError
from structinit.experiments.commands import NO_FLAG, shell_command, train_command
from structinit.experiments.requeue import requeue_self, slurm_job, slurm_requeue_target
from structinit.experiments.stopping import (
    STOP_SIGNALS,
    Stopper,
    TaskInterrupted,
    command_stopper,
    install_process_stopper,
)
from structinit.experiments.torchrun import TorchrunLog, check_nproc, torchrun_env, train_torchrun

#: Seconds between two touches of a running task's ``heartbeat``.
HEARTBEAT_EVERY = 30.0


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
    from structinit.keys import looks_like_key
    from structinit.training.config import TrainConfig
    from structinit.training.rundir import RunDir

    rd = RunDir(run_dir)
    if not rd.path.is_dir():
        raise UsageError(f"run folder {rd.path} does not exist")
    rebuild = "; `structinit bench grid GRID.toml` (the run's grid) sets it aside and writes it again"
    try:
        doc = rd.read_config()
    except StructinitError as exc:
        raise StructinitError(f"{exc}{rebuild}") from None
    if doc is None:
        raise UsageError(f"{rd.path} holds no config.json; launch the grid with structinit bench grid to create it")
    try:
        config = TrainConfig.from_dict(doc["config"])
        key = config.key
    except (KeyError, TypeError, ValueError) as exc:  # UsageError too: settings no run has
        raise StructinitError(f"{rd.file(rd.CONFIG)} is unreadable ({type(exc).__name__}: {exc}){rebuild}") from None
    name = rd.path.resolve().name
    if looks_like_key(name) and key != name:
        raise StructinitError(f"{rd.file(rd.CONFIG)} describes run {key}, not the run {name} its folder is named "
                              "by (was it edited?)")
    return config


# --------------------------------------------------------------------------- the task

class _Log:
    """Appends timestamped lines to the run's ``log.txt`` and echoes them."""

    def __init__(self, run, echo: Optional[Callable[[str], None]]):
        self.run, self.echo = run, echo

    def __call__(self, message: str) -> None:
        line = f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} {message}"
        self.run.append_log(line)
        if self.echo:
            self.echo(line)


def _epoch_line(record: Dict[str, Any], epochs: int) -> str:
    text = f"epoch {record['epoch']}/{epochs}  loss {record['train_loss']:.4f}  train {record['train_acc']:.2f}%"
    for split in ("val", "test"):
        if f"{split}_acc" in record:
            text += f"  {split} {record[split + '_acc']:.2f}%"
    return text + f"  {record.get('epoch_seconds', 0):.1f}s"


def _heartbeat(run, stop: threading.Event) -> None:
    while True:
        run.touch_heartbeat()
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
    stopper = stopper or Stopper()
    if stopper.event.is_set():  # asked to stop before this run began: it is left as it is
        return TaskOutcome(key, str(run_dir), "interrupted", time.perf_counter() - t0)
    try:
        rd.lock()  # train() takes it again in this process; another process gets RunBusy
    except RunBusy:
        return TaskOutcome(key, str(run_dir), "busy", time.perf_counter() - t0)
    log = _Log(rd, echo)
    beat_stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(rd, beat_stop), daemon=True)
    record: Dict[str, Any] = {"state": "running", "key": key, "host": socket.gethostname(), "pid": os.getpid(),
                              "launcher": launcher, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                              "slurm": slurm_job(), "nproc": nproc}
    try:
        if rd.state == "finished":  # finished between the first look and the lock
            return TaskOutcome(key, str(run_dir), "already-finished", time.perf_counter() - t0)
        if stopper.event.is_set():  # asked while it took the lock: nothing is written
            return TaskOutcome(key, str(run_dir), "interrupted", time.perf_counter() - t0)
        rd.write_task(record)
        beat.start()
        config = _task_config(config, run_dir, threads, device, default_threads)
        where = f" (SLURM job {record['slurm']['job_id']})" if record["slurm"] else ""
        state = rd.state
        log(f"task start: run {key} on {record['host']}{where}"
            + (f", resuming after epoch {len(rd.read_metrics())}" if state == "resumable" else "")
            + (f"; it is damaged: {rd.damage()}" if state == "damaged" else ""))
        state, train_seconds, final_acc, error, requeued = _train_and_record(rd, config, record, nproc, stopper, log)
        return TaskOutcome(key, str(run_dir), state, time.perf_counter() - t0, train_seconds, final_acc, error,
                           requeued)
    finally:
        beat_stop.set()
        rd.unlock()


def _train_and_record(rd, config, record: Dict[str, Any], nproc: int, stopper: Stopper,
                      log) -> Tuple[str, float, Optional[float], Optional[str], bool]:
    """Train the run of ``rd`` (here, or under torchrun when ``nproc > 1``), say how it ended in the
    log and in ``task.json`` (``record``, updated), and ask SLURM to requeue it when it was stopped
    to be: ``(state, train seconds, final accuracy, error, requeued)``."""
    t_train = time.perf_counter()
    if nproc > 1:
        state, final_acc, error = train_torchrun(config, nproc, stopper, log)
    else:
        state, final_acc, error = _train_here(config, stopper, log)
    train_seconds = time.perf_counter() - t_train
    if state == "interrupted":
        done = _checkpoint_epoch(rd)
        log(f"task stopped ({stopper.reason}); " + (f"the checkpoint of epoch {done} is kept" if done else
                                                   "no epoch had finished: the next task starts the run afresh"))
    elif state == "failed":
        log(f"error: {error}")
    else:
        log(f"task done: final accuracy {final_acc:.2f}%")
    record.update(state=state, ended=datetime.datetime.now().isoformat(timespec="seconds"),
                  train_seconds=round(train_seconds, 3), error=error, requeued=False)
    rd.write_task(record)  # the run's state is on disk before SLURM is asked to requeue it
    requeued = False
    if state == "interrupted" and stopper.requeue:
        requeued = requeue_self(log)
        if requeued:
            record["requeued"] = True
            rd.write_task(record)
    return state, train_seconds, final_acc, error, requeued


def _task_config(config, run_dir: Path, threads: Optional[int], device: Optional[str],
                 default_threads: Optional[int]):
    """The run's config as this task trains it: resumed in ``run_dir``, with the task's execution
    settings (``threads``, else the run's own, else ``default_threads``; ``device``)."""
    config = dataclasses.replace(config, out=str(run_dir), resume=True)
    if threads is not None:
        config.threads = threads
    elif config.threads is None:
        config.threads = default_threads
    if device is not None:
        config.device = device
    return config


def _checkpoint_epoch(rd) -> int:
    """The epochs in the run's ``checkpoint.pt`` (0 when it has none that reads), which a resume
    continues after: its own record, as ``metrics.jsonl`` may hold an epoch more (it is written
    first)."""
    from structinit.training.rundir import checkpoint_info

    if rd.state != "resumable":
        return 0
    try:
        epoch = checkpoint_info(rd.file(rd.CHECKPOINT)).get("epoch")
    except StructinitError:
        return 0
    return epoch if isinstance(epoch, int) else 0


class GridSyntax(Syntax):
    """How a grid file writes a setting of the init: a key of the row's ``init_params`` table."""

    def setting(self, name: str, value: Any) -> str:
        if isinstance(value, dict):  # a TOML inline table of the JSON scalars it holds
            inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
            return f"init_params.{name} = {{ {inner} }}"
        return f"init_params.{name} = {json.dumps(value)}"


def _train_here(config, stopper: Stopper, log) -> tuple:
    from structinit.training.loop import train

    epochs = int(config.hparams()["epochs"])

    def say_warning(message, category, filename, lineno, file=None, line=None):
        text = message.render(SYNTAX.get()) if hasattr(message, "render") else message
        log(f"warning: {text}")  # one line in the run's log, not Python's two

    def on_epoch(record: Dict[str, Any]) -> None:
        log(_epoch_line(record, epochs))
        stopper.on_epoch(record, epochs)

    syntax = SYNTAX.set(GridSyntax())  # advice in the run's log names the grid's keys
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
    finally:
        SYNTAX.reset(syntax)
    return "finished", result.final_acc, None


__all__ = ["run_task", "TaskOutcome", "Stopper", "TaskInterrupted", "read_run_config", "train_command",
           "requeue_self", "slurm_job", "slurm_requeue_target",
           "install_process_stopper", "command_stopper", "STOP_SIGNALS",
           "NO_FLAG", "shell_command", "TorchrunLog", "check_nproc", "torchrun_env", "GridSyntax"]
