"""The lock of a run folder (:class:`RunLock`): held by the one process that writes the run
(``train``, a grid's task), reentrant within a process, handed to ``torchrun``'s rank 0 by the task
that holds it (:data:`LOCK_HELD_ENV`), and probed without taking it.
:class:`~structinit.training.rundir.RunDir` names the lock file and takes its lock through this.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from structinit.errors import StructinitError

#: A run folder whose lock the parent process holds for this one (``bench run --nproc N`` starts
#: ``torchrun``, whose rank 0 writes the run the task has locked): its resolved path.
LOCK_HELD_ENV = "STRUCTINIT_RUN_LOCK_HELD"


class RunBusy(StructinitError):
    """Another process holds the run folder's lock (it is training or writing the run)."""

    exit_code = 1


class _Held:
    """This process's hold of one run folder's lock: the lock, how many holders, and the folders
    the first holder created for it (removed again when the last one lets go, if empty)."""

    def __init__(self, lock: Any, created: List[Path], path: Path):
        self.lock, self.created, self.folder, self.count = lock, created, path, 1


_HELD: Dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


class RunLock:
    """The lock of the run folder ``folder``, the file ``lock_file`` in it (it need not exist yet)."""

    def __init__(self, folder: Path, lock_file: Path):
        self.folder, self.lock_file = folder, lock_file

    def _key(self) -> str:
        return str(self.folder.expanduser().resolve())

    def acquire(self) -> None:
        """Hold the run's lock (``lock_file``, created with the folder if need be) until
        :meth:`release`. Reentrant within a process (``bench run``'s task holds it while its own call
        of :func:`~structinit.training.loop.train` takes it again); a second process gets
        :class:`RunBusy` at once, naming the folder."""
        from filelock import FileLock, Timeout

        key = self._key()
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is not None:
                held.count += 1
                return
            if os.environ.get(LOCK_HELD_ENV) == key:  # a parent process holds it for this one
                _HELD[key] = _Held(None, [], self.folder)
                return
            missing = [p for p in [self.folder, *self.folder.parents] if not p.exists()][::-1]
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StructinitError(f"cannot create run folder {self.folder}: {exc.strerror or exc}") from None
            lock = FileLock(str(self.lock_file), timeout=0, thread_local=False)
            try:
                try:
                    lock.acquire()
                except Timeout:
                    # Where the file system has no flock, filelock holds a soft lock (a file naming its owner), and
                    # a look that finds its owner dead breaks it but reports the contention (filelock < 4.2.5):
                    # the second look takes it. A lock a live process holds refuses both.
                    lock.acquire()
            except Timeout:
                _remove_empty(missing)
                raise RunBusy(f"run folder {self.folder} is in use: another process is training or writing it (it "
                              "holds the folder's .lock); wait for it to finish, or stop it, and run again") from None
            except OSError as exc:
                _remove_empty(missing)
                raise StructinitError(f"cannot lock run folder {self.folder}: {exc.strerror or exc}") from None
            _HELD[key] = _Held(lock, missing, self.folder)

    def release(self) -> None:
        """Let go of a hold :meth:`acquire` took; the last one removes the lock file (while it still holds
        it, so no other process can be holding it) and the folders the lock created, if empty."""
        key = self._key()
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del _HELD[key]
            if held.lock is None:
                return
            try:
                # flock's lock file is empty, removed here while held so that no other process can be holding it;
                # a soft lock's (no flock on this file system) names its owner, and filelock's release removes it
                if self.lock_file.stat().st_size == 0:
                    self.lock_file.unlink()
            except OSError:
                pass
            held.lock.release()
            _remove_empty(held.created)

    def held_by_anyone(self) -> Optional[bool]:
        """Whether some process holds the lock now (this one included); see :meth:`RunDir.lock_held`."""
        return True if self.held_here() else _lock_probe(self.lock_file)

    def held_here(self) -> bool:
        """Whether this process holds the lock."""
        return self._key() in _HELD


def _lock_probe(lock_file: Path) -> Optional[bool]:
    """Whether some process holds the flock of ``lock_file`` (see :meth:`RunDir.lock_held`)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        fd = os.open(lock_file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing lets go of the probe's lock
    return False


def _remove_empty(folders: List[Path]) -> None:
    """Remove ``folders`` (outermost first) innermost first, stopping at the first that is not empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            break

