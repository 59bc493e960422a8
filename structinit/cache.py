"""Where artifacts live, how they are found, and how concurrent writers stay safe.

Look-up order: the user cache (``--cache-dir``, else ``$STRUCTINIT_CACHE``, else
``$XDG_CACHE_HOME/structinit``, else ``~/.cache/structinit``), then the pre-solved artifacts
shipped with the package (the repository's ``cache/`` folder), which are only ever read.

Writers take an advisory lock per key (``.locks/<name>.lock``) so that many jobs asking for the
same key solve it once; the artifact itself is written to a temp file and ``os.replace``d, so a
reader never sees a partial file even where locks do not work (some network file systems).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

from .artifact import Artifact, read_artifact
from .errors import ArtifactError

ENV_VAR = "STRUCTINIT_CACHE"


def user_cache_dir(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The writable cache folder (see the module docstring for the order)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "structinit"


def shipped_cache_dirs() -> List[Path]:
    """Read-only folders of pre-solved artifacts shipped with structinit (those that exist)."""
    here = Path(__file__).resolve().parent
    candidates = [here.parent / "cache", Path(sys.prefix) / "share" / "structinit" / "cache"]
    return [p for p in candidates if p.is_dir()]


def search_dirs(cache_dir: Optional[os.PathLike] = None) -> List[Path]:
    """Every folder consulted, user cache first."""
    return [user_cache_dir(cache_dir)] + shipped_cache_dirs()


def find_cached(filename: str, cache_dir: Optional[os.PathLike] = None, warn=None) -> Optional[Artifact]:
    """Load the artifact named ``filename`` from the first folder that holds a valid copy.

    A corrupt copy in the user cache is reported through ``warn`` and removed (so it is solved
    again); a corrupt shipped copy is reported and skipped.
    """
    for i, folder in enumerate(search_dirs(cache_dir)):
        path = folder / filename
        if not path.exists():
            continue
        try:
            return read_artifact(path)
        except ArtifactError as exc:
            if warn:
                warn(f"ignoring corrupt artifact: {exc}; it will be recomputed")
            if i == 0:
                _discard(path)
    return None


def _discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def list_artifacts(cache_dir: Optional[os.PathLike] = None) -> Iterator[Path]:
    """Artifact files in every search folder (temp files and locks excluded)."""
    for folder in search_dirs(cache_dir):
        if folder.is_dir():
            yield from sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def resolve_key(key: str, cache_dir: Optional[os.PathLike] = None) -> Optional[Path]:
    """The artifact file whose key (or file name) is ``key``, or ``None``."""
    for path in list_artifacts(cache_dir):
        if path.name == key or path.stem == key or path.stem.endswith("-" + key):
            return path
    return None


@contextmanager
def key_lock(folder: Path, filename: str, timeout: float = 3600.0):
    """Hold an exclusive advisory lock for ``filename`` in ``folder`` (no-op where unsupported)."""
    lock_dir = folder / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: rely on write-then-rename alone
        yield
        return
    with open(lock_dir / (filename + ".lock"), "a+") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # give up waiting; the atomic rename still keeps the artifact whole
                time.sleep(0.05)
            except OSError:
                break  # file system without flock support
        try:
            yield
        finally:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            except OSError:
                pass
