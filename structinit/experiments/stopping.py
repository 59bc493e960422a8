"""How a grid's task (and ``structinit train``) stops on a signal: a :class:`Stopper` shared by
the signal handlers and the training callbacks, installed for the whole process by the entry point
before it loads the command line (:func:`install_process_stopper`) and taken over by the command
(:func:`command_stopper`); the signal mask helpers the task's children start under.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Dict, Optional, Sequence


class TaskInterrupted(Exception):
    """Raised inside training when the task was asked to stop."""


#: The signals a task stops on: SIGTERM (stop) and SIGUSR2 (stop and ask SLURM to requeue; none on
#: Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR2") if hasattr(signal, name))


def signal_mask(how: str, signals) -> Optional[Any]:
    """``signal.pthread_sigmask`` with ``how`` (``"SIG_BLOCK"``, ``"SIG_UNBLOCK"``) of this thread's
    mask, returning the mask it replaced; nothing (``None``) where there are no masks (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(getattr(signal, how), signals)


def restore_mask(mask: Optional[Any]) -> None:
    """Put back a mask :func:`signal_mask` replaced."""
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
        signal_mask("SIG_UNBLOCK", self.signals)

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


