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
from typing import Callable, Iterator, List, Optional, Tuple, Union

from structinit.atomic import NotRegularFile, regular_file, set_aside
from structinit.errors import ArtifactError, Notice, StructinitError, UsageError, param
from structinit.solver.artifact import Artifact, check_stats, nonfinite_tensors, read_artifact, write_artifact

ENV_VAR = "STRUCTINIT_CACHE"
#: Seconds a writer waits for another process solving the same key before giving up with an error.
LOCK_TIMEOUT = 3600.0


def user_cache_dir(cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """The writable cache folder (see the module docstring for the order)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "structinit"


def shipped_cache_dir() -> Optional[Path]:
    """The folder of pre-solved artifacts inside the installed package, or ``None``."""
    # One name per joinpath: Traversable takes several only from Python 3.11 (3.9's zipfile.Path takes one).
    folder = resources.files("structinit").joinpath("data").joinpath("cache")
    return Path(str(folder)) if folder.is_dir() else None


def search_dirs(cache_dir: Union[str, os.PathLike, None] = None) -> List[Path]:
    """Every folder consulted, user cache first."""
    shipped = shipped_cache_dir()
    return [user_cache_dir(cache_dir)] + ([shipped] if shipped else [])


def cache_source(cache_dir: Union[str, os.PathLike, None] = None) -> str:
    """Who chose the user cache folder, as an error names it: ``cache_dir`` (the parameter) when
    given, else ``$STRUCTINIT_CACHE`` when set, else the default's words. A message never blames an
    option the user did not give."""
    if cache_dir:
        return param("cache_dir")
    if os.environ.get(ENV_VAR):
        return f"${ENV_VAR}"
    return "default cache"


def check_cache_dir(cache_dir: Union[str, os.PathLike, None]) -> None:
    """The user cache folder (a given ``cache_dir``, else ``$STRUCTINIT_CACHE``'s), when it exists,
    must be a folder (a missing one is created when written); the error names who chose it."""
    if cache_dir or os.environ.get(ENV_VAR):
        folder = user_cache_dir(cache_dir)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{cache_source(cache_dir)} {cache_dir or os.environ[ENV_VAR]} is not a folder")


def find_cached(filename: str, cache_dir: Union[str, os.PathLike, None] = None,
                warn: Optional[Callable[[str], None]] = None,
                expect: Optional[Tuple[str, bool]] = None) -> Optional[Artifact]:
    """Load the artifact named ``filename`` from the first folder that holds a valid copy.

    ``expect``: ``(key, fitted)``, what the name must hold: an artifact of that key, a fitted one
    or a plain solve. A copy in the user cache that is corrupt, holds something else (another
    artifact copied under this name, an edited header) or is not a regular file (a folder, a FIFO,
    a link to a device or to nothing: nothing is read from it) is reported through ``warn`` and set
    aside (``NAME.set-aside``, never deleted), so that it is computed again; such a shipped copy is
    reported and skipped.
    """
    for i, folder in enumerate(search_dirs(cache_dir)):
        path = folder / filename
        if not os.path.lexists(path):
            continue
        what = "unusable"
        try:
            if path.is_dir():
                raise ArtifactError(f"{path}: a folder, not an artifact file")
            try:
                regular_file(path)  # a FIFO would block the read, a link to /dev/zero never end it
            except NotRegularFile as exc:
                raise ArtifactError(f"{path}: {exc.strerror}") from None
            except FileNotFoundError:  # removed since lexists: nothing here
                continue
            what = "corrupt"
            art = read_artifact(path)
            what = "unusable"
            if expect is not None:
                check_expected(art, *expect)
            check_stats(art)  # Q/K that are not what was solved (scaled, with both checksums made again)
            return art
        except ArtifactError as exc:
            moved = None
            if i == 0:
                try:
                    moved = set_aside(path)
                except OSError as err:
                    raise StructinitError(f"{exc}; and it cannot be set aside ({err.strerror or err}): move it "
                                          "away") from None
            if warn:
                where = f"; set aside as {moved.name}" if moved is not None else ""
                warn(f"ignoring {what} artifact: {exc}{where}; it will be recomputed")
    return None


def check_expected(art: Artifact, key: str, fitted: bool) -> None:
    """Raise :class:`ArtifactError` unless ``art`` is the artifact of ``key``, fitted or plain as asked."""
    kind = "fitted artifact" if art.fit else "plain solve"
    want = "fitted artifact" if fitted else "plain solve"
    if kind != want or art.key != key:
        raise ArtifactError(f"{art.path}: holds the {kind} {art.key}, not the {want} {key} its name asks for")


def load_or_compute(filename: str, compute: Callable[[], Artifact], *, key: str, fitted: bool,
                    cache_dir: Union[str, os.PathLike, None] = None, force: bool = False,
                    warn: Optional[Callable[[str], None]] = None, wait: Optional[Callable[[str], None]] = None,
                    before: Optional[Callable[[], None]] = None, what: str = "solved") -> Tuple[Artifact, bool]:
    """``(artifact, cached)``: the artifact named ``filename`` (of ``key``; ``fitted`` or a plain
    solve) from the cache, else ``compute()``d and stored in the user cache. The one routine of
    every cached artifact (a solve, a fit):

    1. a valid copy of what was asked for is returned (``force`` skips the look-up);
    2. ``before()`` runs (checks that need no lock), the folder is created and the key's lock taken
       (``wait(message)`` hears, in one line, that another process holds it, before waiting);
    3. the cache is read again (the holder may have computed it), else ``compute()`` runs and its
       artifact is written atomically.

    A folder that cannot be created, locked or written is a :class:`StructinitError` naming
    ``cache_dir``, and nothing partial is left in it; ``what`` (``solved``, ``fitted``) says in it
    what was computed."""
    check_cache_dir(cache_dir)
    expect = (key, fitted)
    if warn is not None:  # the cache is read twice (before and under the lock): a copy not set aside is told once
        told: set = set()
        say = warn

        def warn(message: str) -> None:
            if message not in told:
                told.add(message)
                say(message)
    if not force:
        hit = find_cached(filename, cache_dir, warn, expect)
        if hit is not None:
            return hit, True
    if before is not None:
        before()
    folder = user_cache_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StructinitError(f"cannot create the {cache_source(cache_dir)} folder {folder}: {exc.strerror or exc}") \
            from None
    with key_lock(folder, filename, wait=wait, doing="fitting" if fitted else "solving"):
        if not force:  # another process may have computed it while we waited
            hit = find_cached(filename, cache_dir, warn, expect)
            if hit is not None:
                return hit, True
        artifact = compute()
        noun = "fitted artifact" if fitted else "artifact"
        bad = nonfinite_tensors(artifact.tensors())
        if bad:  # never cached, never written into a model
            raise StructinitError(f"the {'data fit' if fitted else 'solve'} produced non-finite values ({bad}); "
                                  "nothing was stored or written")
        try:
            artifact.path = write_artifact(artifact, folder / filename)
        except ArtifactError as exc:  # write_artifact's, its context the OSError of the failed write
            reason = getattr(exc.__context__, "strerror", None) or exc
            raise StructinitError(f"{what}, but cannot write the {noun} into the {cache_source(cache_dir)} {folder}: "
                                  f"{reason}; nothing was stored") from None
    return artifact, False


def list_artifacts(cache_dir: Union[str, os.PathLike, None] = None) -> Iterator[Path]:
    """Artifact files in every search folder (temp files and locks excluded)."""
    for folder in search_dirs(cache_dir):
        if folder.is_dir():
            yield from sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def resolve_key(key: str, cache_dir: Union[str, os.PathLike, None] = None) -> Optional[Path]:
    """The artifact file whose key (or file name) is ``key``, or ``None``."""
    for path in list_artifacts(cache_dir):
        if path.name == key or path.stem == key or path.stem.endswith("-" + key):
            return path
    return None


def resolve_artifact(spec: Union[Artifact, str, os.PathLike],
                     cache_dir: Union[str, os.PathLike, None] = None) -> Artifact:
    """An :class:`~structinit.solver.artifact.Artifact` from an Artifact, a file path, or a key (or
    file name) in the cache. Raises :class:`UsageError` when it names nothing."""
    if isinstance(spec, Artifact):
        return spec
    path = Path(str(spec)).expanduser()
    if os.path.lexists(path) and not path.is_dir():
        found: Optional[Path] = path  # a FIFO or a device is refused by read_artifact, never read
    else:
        found = resolve_key(str(spec), cache_dir)
    if found is None:
        raise UsageError(f"{param('artifact')} {spec}: no such file, and no cached artifact has that key "
                         "(list them with `structinit inspect`)")
    art = read_artifact(found)
    check_stats(art)
    return art


@contextmanager
def key_lock(folder: Path, filename: str, timeout: float = LOCK_TIMEOUT, wait: Optional[Callable[[str], None]] = None,
             doing: str = "solving") -> Iterator[None]:
    """Hold an exclusive lock for ``filename`` in ``folder`` while computing it; raises
    :class:`StructinitError` after ``timeout`` seconds of waiting for another holder. ``wait(message)``
    hears, once, that another process holds the lock (``doing``: ``solving``, ``fitting``), before
    this one waits for it."""
    from filelock import FileLock, Timeout

    lock_dir = folder / ".locks"
    path = lock_dir / (filename + ".lock")
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path), timeout=timeout)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if wait is not None:
                wait(Notice(f"waiting for another process {doing} {filename} (it holds {path}); this one reads "
                            "its result when it is done"))
            lock.acquire()
    except Timeout:
        raise StructinitError(f"waited {timeout:.0f} s for another process {doing} {filename} in {folder}; "
                              f"if none is running, remove {path}") from None
    except OSError as exc:
        raise StructinitError(f"cannot lock the cache folder {folder}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        lock.release()
