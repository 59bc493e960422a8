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
import re
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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from structinit.errors import SYNTAX, StructinitError, Syntax, UsageError, param

#: Seconds between two touches of a running task's ``heartbeat``.
HEARTBEAT_EVERY = 30.0
#: TrainConfig fields that ``structinit train`` has no flag for (execution settings only).
NO_FLAG = ("eval_batch_size",)


class TaskInterrupted(Exception):
    """Raised inside training when the task was asked to stop."""


#: The signals a task stops on: SIGTERM (stop) and SIGUSR2 (stop and ask SLURM to requeue; none on
#: Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR2") if hasattr(signal, name))


def _mask(how: str, signals) -> Optional[Any]:
    """``signal.pthread_sigmask`` with ``how`` (``"SIG_BLOCK"``, ``"SIG_UNBLOCK"``) of this thread's
    mask, returning the mask it replaced; nothing (``None``) where there are no masks (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(getattr(signal, how), signals)


def _unmask(mask: Optional[Any]) -> None:
    """Put back a mask :func:`_mask` replaced."""
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Stopper:
    """A stop request shared by signal handlers and the training callbacks.

    :meth:`request` asks the task to stop; with ``requeue`` the task asks SLURM to requeue it once
    stopped. ``grace`` (seconds between the request and a hard kill, e.g. the ``--signal`` lead
    time) lets the epoch in progress finish when it is expected to fit. ``requeue_signal``:
    whether SIGUSR2 is handled too (stop and requeue); without it only SIGTERM is
    (``structinit train``).
    """

    def __init__(self, grace: Optional[float] = None, requeue_signal: bool = True):
        self.event = threading.Event()
        self.requeue = False
        self.reason: Optional[str] = None
        self.at: Optional[float] = None
        self.grace = grace
        self.signals = STOP_SIGNALS if requeue_signal else STOP_SIGNALS[:1]
        #: Installed by the entry point for the whole process (:func:`install_process_stopper`).
        self.process_wide = False
        self._saved: Dict[int, Any] = {}
        self._epoch_start: Optional[float] = None
        self._epoch_first = 1

    def request(self, reason: str, requeue: bool = False) -> None:
        if not self.event.is_set():
            self.reason, self.at = reason, time.monotonic()
        self.requeue = self.requeue or requeue
        self.event.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == getattr(signal, "SIGUSR2", None):
            self.request("SIGUSR2 (time limit or preemption)", requeue=True)
        else:
            self.request(signal.Signals(signum).name)

    def install(self) -> None:
        """Handle SIGTERM (stop) and SIGUSR2 (stop and requeue) in this (main) thread until
        :meth:`restore` or :meth:`retire`, and unblock them: a launcher starts its workers with
        them blocked, so that one sent while a worker starts waits for this handler instead of
        ending it (it is handled now). Outside the main thread, where Python cannot handle
        signals, nothing is installed: the caller's own :meth:`request` is the only stop."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._saved.setdefault(sig, signal.signal(sig, self._on_signal))
        _mask("SIG_UNBLOCK", self.signals)

    def restore(self) -> None:
        """Put back the signal handlers :meth:`install` replaced (for a caller that goes on)."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}

    def retire(self) -> None:
        """For a process whose work is done and reported and which now exits: ignore the stop
        signals from here on. Putting the default handlers back (:meth:`restore`) would let one
        that arrives while the process exits end it by the signal, and so would keeping this
        handler: Python puts the default handlers back itself before it unloads its modules
        (seconds with torch loaded), but leaves an ignored signal ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        self._saved = {}

    def release(self) -> None:
        """:meth:`retire` for the process-wide stopper (the process exits next), else
        :meth:`restore` (an in-process call, which goes on)."""
        if self.process_wide:
            self.retire()
        else:
            self.restore()

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


_PROCESS_STOPPER: Optional[Stopper] = None


def install_process_stopper(argv: Sequence[str]) -> Optional[Stopper]:
    """For the entry point, before it loads the command line: when ``argv`` (the arguments after
    the program) runs a command that stops cleanly on signals, ``bench run`` (SIGTERM and SIGUSR2)
    or ``train`` (SIGTERM), install its :class:`Stopper` for the whole process now, so that a
    signal while the rest of the program loads is a stop request, not the end of the process; the
    command takes it over (:func:`command_stopper`). ``None`` for any other command, or outside the
    main thread."""
    global _PROCESS_STOPPER
    args = list(argv)
    if args[:2] == ["bench", "run"]:
        requeue_signal = True
    elif args[:1] == ["train"]:
        requeue_signal = False
    else:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    if _PROCESS_STOPPER is None:
        stopper = Stopper(requeue_signal=requeue_signal)
        stopper.process_wide = True
        stopper.install()
        _PROCESS_STOPPER = stopper
    return _PROCESS_STOPPER


def command_stopper(grace: Optional[float] = None, requeue_signal: bool = True) -> Stopper:
    """The :class:`Stopper` a command stops on, installed: the process-wide one when the entry point
    installed it (:func:`install_process_stopper`; a signal it got meanwhile is kept), with
    ``grace``; else a new one (an in-process call). End with :meth:`Stopper.release`."""
    stopper = _PROCESS_STOPPER
    if stopper is not None and (len(stopper.signals) > 1) == requeue_signal:
        stopper.grace = grace
        return stopper
    stopper = Stopper(grace, requeue_signal=requeue_signal)
    stopper.install()
    return stopper


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


#: What ``scontrol requeue`` says when trying again cannot help (the job may not be requeued, or
#: is not this job); anything else (a controller too busy to answer in time) is tried again.
REQUEUE_REFUSALS = ("disabled", "invalid job id", "access", "permission", "not supported", "only")


def requeue_self(log: Callable[[str], None], attempts: int = 3, pause: float = 2.0) -> bool:
    """Ask SLURM to requeue this job, and only this task of an array (``scontrol requeue``
    :func:`slurm_requeue_target`); ``False`` if it cannot. A failure SLURM may get over (a busy
    controller's time-out) is tried again, ``attempts`` times in all, ``pause`` seconds apart
    (then twice that); a job already requeued (by the scheduler, as a preemption does) counts as
    requeued. Call it once the run's state is saved: SLURM ends the job's processes (SIGTERM, then
    SIGKILL) as it requeues it."""
    job = slurm_requeue_target()
    if not job:
        log("not under SLURM: cannot requeue; run the task again to resume")
        return False
    why = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(pause * attempt)
        try:
            r = _shielded(["scontrol", "requeue", job], timeout=30)
        except FileNotFoundError as exc:
            log(f"scontrol requeue {job} failed: {exc}")
            return False
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
            continue
        if r.returncode == 0:
            log(f"requeued SLURM job {job}; the run resumes from its checkpoint when the task starts again")
            return True
        why = " ".join((r.stderr or r.stdout or f"exit code {r.returncode}").split())
        if "pending" in why.lower():  # ESLURM_JOB_PENDING: requeued already
            log(f"SLURM job {job} is requeued already ({why}); the run resumes from its checkpoint when the task "
                "starts again")
            return True
        if any(word in why.lower() for word in REQUEUE_REFUSALS):
            break
    log(f"scontrol requeue {job} failed: {why}")
    return False


def _shielded(cmd: List[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` (its output captured, as text) with SIGTERM and SIGUSR2 blocked: the SIGTERM
    with which SLURM ends a job it requeues must not end the ``scontrol`` that asked for it before
    it has the answer."""
    mask = _mask("SIG_BLOCK", STOP_SIGNALS)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        _unmask(mask)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
        t_train = time.perf_counter()
        if nproc > 1:
            state, final_acc, error = _train_torchrun(config, nproc, stopper, log)
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
        return TaskOutcome(key, str(run_dir), state, time.perf_counter() - t0, train_seconds, final_acc, error,
                           requeued)
    finally:
        beat_stop.set()
        rd.unlock()


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


def torchrun_env(config, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of the ``torchrun`` a task starts for ``config`` (a ``TrainConfig``):
    ``environ`` (default this process's) with one CPU thread per process unless ``config.threads``
    says otherwise, and :data:`~structinit.training.rundir.LOCK_HELD_ENV` naming the run folder,
    whose lock this task holds, so that torchrun's rank 0 writes the run for it instead of being
    refused as a second writer."""
    from structinit.training.rundir import LOCK_HELD_ENV

    return dict(os.environ if environ is None else environ, OMP_NUM_THREADS=str(config.threads or 1),
                **{LOCK_HELD_ENV: str(Path(config.out).expanduser().resolve())})


def _train_torchrun(config, nproc: int, stopper: Stopper, log) -> tuple:
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
    blocked = _mask("SIG_BLOCK", STOP_SIGNALS if linux else STOP_SIGNALS[1:])
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    finally:
        _unmask(blocked)

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


__all__ = ["run_task", "TaskOutcome", "Stopper", "TaskInterrupted", "read_run_config", "train_command",
           "requeue_self", "slurm_job", "slurm_requeue_target",
           "install_process_stopper", "command_stopper", "STOP_SIGNALS"]
