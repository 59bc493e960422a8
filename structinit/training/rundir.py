"""A training run's directory and its files.

=================  =============================================================================
``config.json``    the settings as given and as resolved, the run key, the init report, the
                   versions the run (re)started under (``versions``)
``metrics.jsonl``  one JSON record per finished epoch
``checkpoint.pt``  everything needed to resume (timm's ``{'state_dict', 'epoch', 'arch', 'args'}``
                   layout plus optimizer, RNG and metrics), written atomically after every epoch
``best.pt``        the weights of the best epoch on the validation split (on the test split when
                   there is none; labelled so in ``final.json``)
``final.json``     the result: final-epoch accuracy first, the best epoch labelled as such, and
                   ``versions``: what its last epoch ran under (Python, torch, timm, numpy, the
                   platform, the device; :func:`structinit.runtime.software_versions`)
``.lock``          held by the process that writes the run (``train``, a grid's task); it exists
                   only while one does
``task.json``      a grid task's state (``running``, ``finished``, ``failed``, ``interrupted``),
                   where and when it ran (:mod:`structinit.experiments.task`)
``log.txt``        every grid task's log lines, appended
``heartbeat``      touched every 30 s while a grid task runs (its age says whether one does)
``damaged-*/``     files set aside (:meth:`RunDir.set_aside`) and ``why.txt``, why
=================  =============================================================================

This module is the one owner of these names and of every read and write of them: the loop, a
grid's task, its status and its report go through :class:`RunDir`, and every read or append goes
through :mod:`structinit.atomic`'s checked path (a FIFO or a device put at one of these names is
refused, never waited on).

A run is *fresh* (no checkpoint), *resumable* (a checkpoint, no ``final.json``), *finished* or
*damaged*. Nothing on disk is trusted: a run is finished only when its ``final.json`` parses as a
dict with a numeric ``final_acc``, its key is ``config.json``'s, and ``checkpoint.pt`` is readable
(:func:`checkpoint_info`, which runs nothing of the file and needs no torch) and holds the last
epoch; a ``final.json`` that fails any of these, or a ``checkpoint.pt`` that cannot be read, makes
the run *damaged* (:meth:`RunDir.damage` says why). Resuming a damaged run moves the damaged files
into a ``damaged-<time>/`` folder of the run (:meth:`RunDir.set_aside`; nothing is deleted) and
trains what is missing.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from structinit.atomic import (
    NotRegularFile,
    append_line,
    atomic_write,
    read_regular,
    read_regular_text,
    touch,
    write_text,
)
from structinit.errors import StructinitError, StructinitWarning, UsageError, param, path_error
from structinit.training.run_checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_info,
    load_run_weights,
    load_train_checkpoint,
)
from structinit.training.run_lock import LOCK_HELD_ENV, RunBusy, RunLock

#: Run folders whose ``log.txt`` could not be written (warned once each).
_LOG_WARNED: "set[Path]" = set()

#: How ``metrics.jsonl``'s epoch-0 line (the init's, written with sorted keys) begins.
INIT_LINE = b'{"epoch": 0,'


class RunFiles:
    """The files of the run folder ``path``: their names, and every read and write of them (JSON,
    metrics lines, a grid task's files, checkpoints), each through :mod:`structinit.atomic`."""

    CONFIG, METRICS, CHECKPOINT, BEST, FINAL = "config.json", "metrics.jsonl", "checkpoint.pt", "best.pt", "final.json"
    TASK, LOG, HEARTBEAT, LOCK, WHY = "task.json", "log.txt", "heartbeat", ".lock", "why.txt"
    #: The files a run writes as it trains (``config.json`` is its settings, kept when it is set aside).
    RESULTS = (FINAL, CHECKPOINT, BEST, METRICS)

    path: Path

    def file(self, name: str) -> Path:
        return self.path / name

    def holds_run(self) -> bool:
        """Whether anything a run writes is here (its config, a checkpoint, metrics or a result):
        a fresh run never replaces such a file, whoever wrote it."""
        return any(self.file(n).exists() for n in (self.CONFIG, self.CHECKPOINT, self.BEST, self.FINAL, self.METRICS))

    # ---- JSON files
    def _write_text(self, name: str, text: str) -> None:
        try:
            write_text(self.file(name), text)
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(name)}: {exc.strerror or exc}") from None

    def _read_json(self, name: str) -> Optional[Dict[str, Any]]:
        path = self.file(name)
        try:
            return json.loads(read_regular_text(path))
        except FileNotFoundError:
            return None
        except NotRegularFile as exc:
            raise StructinitError(f"{path} is unreadable: {exc.strerror}") from None
        except (OSError, ValueError) as exc:
            raise StructinitError(f"{path} is unreadable ({exc})") from None

    def peek_json(self, name: str) -> Any:
        """What the JSON file ``name`` holds, or ``None`` when it is missing or does not parse (a
        report or a status reads runs other processes are writing, and says what it could not read)."""
        try:
            return json.loads(read_regular_text(self.file(name)))
        except (OSError, ValueError):
            return None

    def write_config(self, doc: Dict[str, Any]) -> None:
        self._write_text(self.CONFIG, json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")

    def read_config(self) -> Optional[Dict[str, Any]]:
        return self._read_json(self.CONFIG)

    def write_final(self, summary: Dict[str, Any]) -> None:
        self._write_text(self.FINAL, json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def read_final(self) -> Optional[Dict[str, Any]]:
        return self._read_json(self.FINAL)

    def clear_final(self) -> None:
        self.file(self.FINAL).unlink(missing_ok=True)

    # ---- metrics
    def read_metrics(self, strict: bool = True) -> List[Dict[str, Any]]:
        """The epoch records of ``metrics.jsonl``, epochs 1 on (the init's epoch-0 line and a torn
        last line are left out); ``strict=False``: none from a file that cannot be read."""
        path = self.file(self.METRICS)
        rows = []
        try:
            text = read_regular_text(path)
        except FileNotFoundError:
            text = ""
        except OSError:
            if strict:
                raise
            text = ""
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return [r for r in rows if not (isinstance(r, dict) and r.get("epoch") == 0)]

    def epochs_recorded(self) -> int:
        """Epoch records in ``metrics.jsonl``, counted by lines (the init's epoch-0 line left out):
        cheap, for a grid's status."""
        try:
            raw = read_regular(self.file(self.METRICS))
        except OSError:
            return 0
        return sum(1 for line in raw.splitlines() if line.strip() and not line.startswith(INIT_LINE))

    def age(self, name: str, now: float) -> Optional[float]:
        """Seconds since file ``name`` was last written (``None`` when there is none)."""
        try:
            return now - self.file(name).stat().st_mtime
        except OSError:
            return None

    def write_metrics(self, rows: List[Dict[str, Any]]) -> None:
        self._write_text(self.METRICS, "".join(json.dumps(m, sort_keys=True) + "\n" for m in rows))

    def append_metrics(self, record: Dict[str, Any]) -> None:
        try:
            append_line(self.file(self.METRICS), json.dumps(record, sort_keys=True))
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(self.METRICS)}: {exc.strerror or exc}") from None

    # ---- a grid task's files
    def write_task(self, doc: Dict[str, Any]) -> None:
        """Write ``task.json`` (a grid task's record, see :mod:`structinit.experiments.task`)."""
        self._write_text(self.TASK, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")

    def read_task(self) -> Optional[Dict[str, Any]]:
        """``task.json`` (``None`` when there is none or it does not parse)."""
        doc = self.peek_json(self.TASK)
        return doc if isinstance(doc, dict) else None

    def append_log(self, line: str) -> None:
        """Append one line to ``log.txt``. A line that cannot be written (a full disk, a FIFO or a
        folder in its place) does not stop the run: the first such line warns, once per folder, that
        the log is not kept there (its lines are still echoed where the task prints them)."""
        try:
            append_line(self.file(self.LOG), line, sync=False)
        except OSError as exc:
            if self.path not in _LOG_WARNED:
                _LOG_WARNED.add(self.path)
                warnings.warn(f"cannot write {self.file(self.LOG)} ({exc.strerror or exc}): this run's log lines "
                              "are not kept there", StructinitWarning, stacklevel=2)

    def last_log_line(self, limit: int = 4096) -> Optional[str]:
        """The last non-empty line of ``log.txt`` (read from its last ``limit`` bytes)."""
        try:
            text = read_regular(self.file(self.LOG), tail=limit).decode("utf-8", "replace")
        except OSError:
            return None
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else None

    def touch_heartbeat(self) -> None:
        """Mark a grid task alive (``heartbeat``'s time; one that cannot be touched is skipped)."""
        try:
            touch(self.file(self.HEARTBEAT))
        except OSError:
            pass

    # ---- checkpoints
    def _save(self, obj: Any, name: str) -> None:
        from structinit.atomic import save_torch

        try:
            save_torch(obj, self.file(name))
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(name)}: {exc.strerror or exc}") from None

    def save_checkpoint(self, state: Dict[str, Any]) -> None:
        self._save(dict(state, format=CHECKPOINT_FORMAT), self.CHECKPOINT)

    def save_best(self, state: Dict[str, Any]) -> None:
        self._save(state, self.BEST)

    def load_checkpoint(self, map_location="cpu") -> Dict[str, Any]:
        """``checkpoint.pt`` (read with ``weights_only=True``)."""
        return load_train_checkpoint(self.file(self.CHECKPOINT), map_location)


class RunDir(RunFiles):
    """The run directory at ``path`` (it need not exist yet): its files (:class:`RunFiles`), its lock
    (:class:`~structinit.training.run_lock.RunLock`), what counts as finished or damaged, and the
    setting aside of damaged files."""

    def __init__(self, path: Union[str, os.PathLike]):
        if str(path).strip() == "":
            raise UsageError(f"{param('out')} needs a folder name")
        self.path = Path(path)
        _refuse_impossible(self.path)
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"{param('out')} {self.path} exists and is not a directory")
        self.created: List[Path] = []  # folders create() made, outermost first
        self.opened = False  # create() was called and nothing discarded since: the files here are this run's
        self.config_before: Optional[bytes] = None  # the config.json create() found (a grid's), put back on discard

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def state(self) -> str:
        """``fresh``, ``resumable``, ``finished`` or ``damaged`` (see the module docstring)."""
        if self.damage() is not None:
            return "damaged"
        if self.file(self.FINAL).is_file():
            return "finished"
        return "resumable" if self.file(self.CHECKPOINT).is_file() else "fresh"

    def damage(self) -> Optional[str]:
        """Why the files here are not a sound run (``None`` when they are, or are a run not yet
        finished): a ``checkpoint.pt`` that cannot be read, or a ``final.json`` that does not parse
        as a result, belongs to another run than ``config.json``, or has no readable checkpoint of
        the last epoch beside it. Reads no tensor, runs nothing of the files, needs no torch."""
        return _damage(self)[0]

    def set_aside(self) -> Optional[Path]:
        """Move the damaged files (see :meth:`damage`) into a new ``damaged-<time>/`` folder of the
        run and return it (``None`` when nothing is damaged). A readable checkpoint is kept (the run
        resumes from it); without one every file the run wrote as it trained goes (it starts
        afresh). ``config.json`` stays. Call it holding the lock."""
        why, files = _damage(self)
        if why is None:
            return None
        return self.set_aside_files(files, why)

    def set_aside_files(self, files: List[str], why: str) -> Path:
        """Move the files ``files`` of the run into a new ``damaged-<time>/`` folder of the run, with
        ``why.txt`` saying ``why``, and return that folder (nothing is deleted)."""
        return _move_aside(self, files, why)

    # ---- the lock
    @property
    def _lock(self) -> RunLock:
        return RunLock(self.path, self.file(self.LOCK))

    def lock(self) -> None:
        """Hold the run's lock (``.lock`` in the folder, created with the folder if need be) until
        :meth:`unlock`. Reentrant within a process (``bench run``'s task holds it while its own call
        of :func:`~structinit.training.loop.train` takes it again); a second process gets
        :class:`RunBusy` at once, naming the folder."""
        self._lock.acquire()

    def unlock(self) -> None:
        """Let go of a hold :meth:`lock` took; the last one removes ``.lock`` (while it still holds
        it, so no other process can be holding it) and the folders the lock created, if empty."""
        self._lock.release()

    def lock_held(self) -> Optional[bool]:
        """Whether some process holds the run's lock now (this one included): ``False`` when
        ``.lock`` is missing or nobody holds it (a task killed outright leaves it free), ``None``
        where that cannot be told (a file system without ``flock``). Creates nothing; the probe is a
        shared lock held for an instant."""
        return self._lock.held_by_anyone()

    def locked(self) -> bool:
        """Whether this process holds the run's lock."""
        return self._lock.held_here()

    def create(self) -> None:
        missing = [p for p in [self.path, *self.path.parents] if not p.exists()][::-1]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StructinitError(f"cannot create run folder {self.path}: {exc.strerror or exc}") from None
        try:
            self.config_before = read_regular(self.file(self.CONFIG))
        except OSError:  # none yet, or not a file to put back
            self.config_before = None
        self.created, self.opened = missing, True

    def discard_unstarted(self) -> None:
        """After a failure (or a stop) before the first checkpoint: remove what this run wrote
        (``config.json``, ``metrics.jsonl``, ``best.pt``) and the folders it created, so no
        half-made run is left behind. A ``config.json`` that was there before the run wrote its own
        (a grid's run, which its next task reads) is put back as it was. A folder holding anything
        else is kept. Done once: what is written here afterwards is not this run's."""
        if not self.opened or self.file(self.CHECKPOINT).exists():
            return
        for name in (self.CONFIG, self.METRICS, self.BEST):
            try:
                if name == self.CONFIG and self.config_before is not None:
                    with atomic_write(self.file(name), "wb") as f:
                        f.write(self.config_before)
                else:
                    self.file(name).unlink()
            except OSError:  # not there, or not removable: nothing of it to undo
                pass
        for folder in reversed(self.created):
            try:
                folder.rmdir()  # only if empty
            except OSError:
                break
        self.opened = False


def _move_aside(run: "RunDir", files: List[str], why: str) -> Path:
    """:meth:`RunDir.set_aside_files`."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder, k = run.path / f"damaged-{stamp}", 1
    while folder.exists():
        k += 1
        folder = run.path / f"damaged-{stamp}-{k}"
    try:
        folder.mkdir()
        for name in files:
            os.replace(run.file(name), folder / name)
        write_text(folder / run.WHY, why + "\n")
    except OSError as exc:
        raise StructinitError(f"cannot set the damaged files of {run.path} aside into {folder}: "
                              f"{exc.strerror or exc}") from None
    return folder


def _refuse_impossible(path: Path) -> None:
    """A :class:`UsageError` naming ``out`` for a path where no folder can be: a loop of symbolic
    links, or a name too long."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENAMETOOLONG):
            raise path_error(exc, param("out")) from None


def _damage(run: "RunDir"):
    """``(why, files to set aside)``, or ``(None, [])`` for a sound run (see :meth:`RunDir.damage`)."""
    present = [n for n in run.RESULTS if os.path.lexists(run.file(n))]
    odd = [n for n in present if n != run.CHECKPOINT and not run.file(n).is_file()]
    if odd:  # a FIFO, a device, a folder or a dangling link: nothing a run wrote (a checkpoint is checked below)
        return f"{', '.join(odd)}: not a regular file", odd
    ck_path, final_path = run.file(run.CHECKPOINT), run.file(run.FINAL)
    ck: Optional[Dict[str, Any]] = None
    ck_why: Optional[str] = None
    if ck_path.exists():
        try:
            ck = checkpoint_info(ck_path)
            if ck.get("format") != CHECKPOINT_FORMAT or not isinstance(ck.get("epoch"), int):
                ck, ck_why = None, f"{ck_path} is not a structinit training checkpoint"
        except StructinitError as exc:
            ck_why = str(exc)
    config = None
    try:
        config = run.read_config()
    except StructinitError:
        pass
    key = config.get("key") if isinstance(config, dict) else None
    if ck is not None and key is not None and ck.get("key") not in (None, key):
        ck_why = f"{ck_path} is run {ck.get('key')}'s checkpoint, not run {key}'s"
        ck = None
    if ck_why is not None:
        return ck_why, present  # no checkpoint to resume from: everything it trained goes
    if not final_path.exists():
        if ck is None and present and key is None:  # no run's config.json, no checkpoint: no run wrote these
            return (f"{', '.join(present)} but no {run.CHECKPOINT} and no run's {run.CONFIG}: not the files of a "
                    "run that can be resumed", present)
        return None, []
    final: Any
    why: Optional[str]
    try:
        final = json.loads(read_regular_text(final_path))
    except (OSError, ValueError) as exc:
        final, why = None, f"{final_path} does not parse ({type(exc).__name__})"
    else:
        why = None
    if final is not None:
        acc = final.get("final_acc") if isinstance(final, dict) else None
        if not isinstance(final, dict):
            why = f"{final_path} holds a {type(final).__name__}, not a result"
        elif isinstance(acc, bool) or not isinstance(acc, (int, float)):
            why = f"{final_path} has no numeric final_acc"
        elif key is None:
            why = f"{run.file(run.CONFIG)} is missing or unreadable, so {final_path} cannot be checked"
        elif final.get("key") != key:
            why = f"{final_path} is run {final.get('key')}'s result, not run {key}'s"
        elif ck is None:
            why = f"{final_path} has no {run.CHECKPOINT} beside it"
        else:
            assert config is not None  # key was read from it
            last = ((config.get("resolved") or {}).get("hparams") or {}).get("epochs", final.get("epochs"))
            if ck["epoch"] != last or final.get("epochs") != last:
                why = (f"{final_path} reports {final.get('epochs')} epoch(s) and {ck_path} holds epoch "
                       f"{ck['epoch']}, of {last}")
    if why is None:
        return None, []
    return why, ([run.FINAL] if ck is not None else present)


__all__ = ["RunDir", "RunFiles", "RunBusy", "LOCK_HELD_ENV", "CHECKPOINT_FORMAT", "checkpoint_info",
           "load_train_checkpoint", "load_run_weights", "INIT_LINE"]
