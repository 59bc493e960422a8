"""Atomic file writes: a reader sees the old file or the whole new one, never a partial one; and
an output that must not replace anything is created exclusively (of two writers, one wins and the
other is told)."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional


class OutputExists(FileExistsError):
    """``atomic_write(..., exclusive=True)`` found its path taken (another writer got there first)."""


@contextmanager
def atomic_write(path: os.PathLike, mode: str = "wb", exclusive: bool = False,
                 file_mode: Optional[int] = None) -> Iterator[IO]:
    """Open a hidden temp file beside ``path``; on a clean exit flush, fsync and move it onto
    ``path``. On an exception (or a killed process) ``path`` is untouched and the temp file is
    removed (a killed process leaves only ``.NAME.PID.RAND.tmp``, which nothing loads).

    ``exclusive``: never replace an existing ``path``: the finished file is hard-linked to it, which
    fails if the name is taken, so of concurrent writers exactly one succeeds and the others get
    :class:`OutputExists` (where the file system has no hard links, the name is claimed with
    ``O_CREAT | O_EXCL`` and then replaced). ``file_mode``: the permission bits of the result
    (e.g. the input's, for a file derived from it); default: the umask's.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if file_mode is not None:
            os.chmod(tmp, file_mode & 0o7777)
        if exclusive:
            _link_exclusive(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_torch(obj, path: os.PathLike, **options) -> None:
    """``torch.save(obj)`` through :func:`atomic_write` (``options`` are its keywords). A write that
    fails (a full disk) raises the ``OSError`` itself: torch's zip writer otherwise hides it behind
    a ``RuntimeError`` raised while it cleans up."""
    import torch

    try:
        with atomic_write(path, **options) as fh:
            torch.save(obj, fh)
    except RuntimeError as exc:
        cause = exc.__context__ or exc.__cause__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__ or cause.__cause__
        if cause is None:
            raise
        raise cause from None


def _link_exclusive(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise OutputExists(errno.EEXIST, "already exists", str(path)) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    try:  # no hard links here: claim the name, then replace the (empty) claim
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        raise OutputExists(errno.EEXIST, "already exists", str(path)) from None
    os.replace(tmp, path)


def claim_backup(path: os.PathLike) -> Path:
    """A new, never-used backup name for ``path`` holding its current content: ``PATH.bak``, else
    ``PATH.bak.1``, ``PATH.bak.2``, ... An existing backup is never touched. The backup is a hard
    link to ``path``'s file (so replacing ``path`` afterwards leaves it the old content), or an
    exclusive copy where links are not possible."""
    import shutil

    path = Path(path)
    for i in range(10000):
        backup = path.with_name(path.name + (".bak" if i == 0 else f".bak.{i}"))
        try:
            os.link(path, backup)
            return backup
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        try:
            with atomic_write(backup, exclusive=True, file_mode=path.stat().st_mode) as dst, open(path, "rb") as src:
                shutil.copyfileobj(src, dst)
            return backup
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free backup name", str(path))


def set_aside(path: os.PathLike, suffix: str = ".set-aside") -> Path:
    """Move ``path`` (a file or a folder) to a new, never-used name beside it, ``PATH.set-aside``,
    else ``PATH.set-aside.1``, ... (``suffix`` instead of ``.set-aside``), and return that name: what
    cannot be used is kept for a person to look at, never deleted, and nothing already set aside is
    replaced."""
    path = Path(path)
    for i in range(10000):
        dest = path.with_name(path.name + (suffix if i == 0 else f"{suffix}.{i}"))
        if os.path.lexists(dest):
            continue
        if path.is_dir() and not path.is_symlink():
            os.rename(path, dest)  # a folder: no hard link; the name was free a moment ago
            return dest
        try:
            os.link(path, dest, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            os.rename(path, dest)
            return dest
        path.unlink()
        return dest
    raise FileExistsError(errno.EEXIST, "no free name to set aside", str(path))
