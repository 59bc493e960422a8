"""Where artifacts live, how they are found, and how concurrent writers stay safe.

Look-up order: the user cache (``cache_dir``, else ``$STRUCTINIT_CACHE``, else
``$XDG_CACHE_HOME/structinit``, else ``~/.cache/structinit``), then the pre-solved artifacts
shipped inside the package (``structinit/data/cache``, read through :mod:`importlib.resources`),
which are only ever read.

Writers hold a lock file per key (``.locks/<name>.lock``, :mod:`filelock`) so that many jobs
asking for the same key solve it once; the artifact itself is written to a temp file and
``os.replace``d, so a reader never sees a partial file even where locks do not work.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Iterator, List, Optional

from structinit.errors import ArtifactError, StructinitError, UsageError, param
from structinit.solver.artifact import Artifact, read_artifact

ENV_VAR = "STRUCTINIT_CACHE"
#: Seconds a writer waits for another process solving the same key before giving up with an error.
LOCK_TIMEOUT = 3600.0


def user_cache_dir(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The writable cache folder (see the module docstring for the order)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "structinit"


def shipped_cache_dir() -> Optional[Path]:
    """The folder of pre-solved artifacts inside the installed package, or ``None``."""
    folder = resources.files("structinit").joinpath("data", "cache")
    return Path(str(folder)) if folder.is_dir() else None


def search_dirs(cache_dir: Optional[os.PathLike] = None) -> List[Path]:
    """Every folder consulted, user cache first."""
    shipped = shipped_cache_dir()
    return [user_cache_dir(cache_dir)] + ([shipped] if shipped else [])


def check_cache_dir(cache_dir: Optional[os.PathLike]) -> None:
    """A given ``cache_dir`` that exists must be a folder (a missing one is created when written)."""
    if cache_dir and Path(cache_dir).expanduser().exists() and not Path(cache_dir).expanduser().is_dir():
        raise UsageError(f"{param('cache_dir')} {cache_dir} is not a folder")


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
                path.unlink(missing_ok=True)
    return None


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


def resolve_artifact(spec, cache_dir: Optional[os.PathLike] = None) -> Artifact:
    """An :class:`~structinit.solver.artifact.Artifact` from an Artifact, a file path, or a key (or
    file name) in the cache. Raises :class:`UsageError` when it names nothing."""
    if isinstance(spec, Artifact):
        return spec
    path = Path(str(spec)).expanduser()
    if path.is_file():
        return read_artifact(path)
    found = resolve_key(str(spec), cache_dir)
    if found is None:
        raise UsageError(f"{param('artifact')} {spec}: no such file, and no cached artifact has that key "
                         "(list them with `structinit inspect`)")
    return read_artifact(found)


@contextmanager
def key_lock(folder: Path, filename: str, timeout: float = LOCK_TIMEOUT):
    """Hold an exclusive lock for ``filename`` in ``folder`` while solving it; raises
    :class:`StructinitError` after ``timeout`` seconds of waiting for another holder."""
    from filelock import FileLock, Timeout

    lock_dir = folder / ".locks"
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_dir / (filename + ".lock")), timeout=timeout)
        lock.acquire()
    except Timeout:
        raise StructinitError(f"waited {timeout:.0f} s for another process solving {filename} in {folder}; "
                              f"if none is running, remove {lock_dir / (filename + '.lock')}") from None
    except OSError as exc:
        raise StructinitError(f"cannot lock the cache folder {folder}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        lock.release()
