"""Atomic file writes: a reader sees the old file or the whole new one, never a partial one."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_write(path: os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a hidden temp file beside ``path``; on a clean exit flush, fsync and ``os.replace`` it
    onto ``path``. On an exception (or a killed process) ``path`` is untouched and the temp file
    is removed (a killed process leaves only ``.NAME.PID.RAND.tmp``, which nothing loads)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in a few words: the ``OSError`` behind ``exc`` (``No space left on
    device``), also when a writer such as ``torch.save`` wraps it in a ``RuntimeError``; else the
    first line of ``exc``."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
