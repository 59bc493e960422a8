"""The one writer of every file structinit writes. Atomic file writes: a reader sees the old file
or the whole new one, never a partial one; an output that must not replace anything is created
exclusively (of two writers, one wins and the other is told); a log or record of lines is appended
a line at a time (:func:`append_line`). And the other way: what is read from a path the user or
the cache gives is a regular file of a size known before reading (:func:`regular_file`,
:func:`read_regular`), never a FIFO (a read that would wait forever for a writer) or a device
(``/dev/zero`` never ends)."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, Optional


class NotRegularFile(OSError):
    """A path that names something other than a regular file (a FIFO, a device, a socket, a folder)
    or a symbolic link to nothing; ``strerror`` says which, in words."""


def _kind(mode: int) -> str:
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def regular_file(path: os.PathLike) -> os.stat_result:
    """``os.stat(path)`` when ``path`` is (or links to) a regular file; else :class:`NotRegularFile`
    saying what it is: reading a FIFO waits for a writer that may never come, and a device such as
    ``/dev/zero`` never ends. A missing path raises :class:`FileNotFoundError`; a symbolic link to
    a missing path, :class:`NotRegularFile` naming where it points; a loop of links,
    :class:`NotRegularFile` (``errno.ELOOP``) saying so."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            to = os.readlink(os.fspath(path))
            raise NotRegularFile(errno.ENOENT, f"a symbolic link to {to}, which does not exist", str(path)) from None
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a loop of symbolic links (one that leads back to itself), not a "
                                 "regular file", str(path)) from None
        raise
    if not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file" if kind.startswith("a ") else kind, str(path))
    return st


def read_regular(path: os.PathLike, limit: Optional[int] = None,
                 check: Optional[Callable[[IO[bytes], int], None]] = None, tail: Optional[int] = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`regular_file`), opened without blocking and
    checked again on the open descriptor (so a FIFO put in its place meanwhile is refused, not waited
    for). ``limit``: refuse (:class:`NotRegularFile`) a file larger than this many bytes before
    reading it. ``check(fh, size)``: called with the open file and its size before the file is read
    (it may read a header; it raises to refuse the file, e.g. a header that promises another size).
    ``tail``: only the last this many bytes (the end of a log)."""
    regular_file(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file", str(path))
        if limit is not None and st.st_size > limit:
            raise NotRegularFile(errno.EFBIG, f"{st.st_size} bytes, more than such a file holds (at most {limit})",
                                 str(path))
        if check is not None:
            check(fh, st.st_size)
            fh.seek(0)
        if tail is not None and st.st_size > tail:
            fh.seek(st.st_size - tail)
            return fh.read(tail)
        return fh.read(st.st_size)


def read_regular_text(path: os.PathLike, limit: Optional[int] = None) -> str:
    """The text (UTF-8, undecodable bytes replaced) of the regular file ``path``, through
    :func:`read_regular` (a FIFO or a device raises :class:`NotRegularFile`, never waits)."""
    return read_regular(path, limit).decode("utf-8", "replace")


#: The longest file name (one path component, in bytes) where the system does not say: Linux's,
#: macOS's and most file systems'.
NAME_MAX = 255


def name_max(folder: os.PathLike) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or of its nearest existing parent)
    allows."""
    folder = Path(folder)
    for candidate in (folder, *folder.parents):
        try:
            return int(os.pathconf(candidate if str(candidate) else ".", "PC_NAME_MAX"))
        except (OSError, ValueError):
            continue
    return NAME_MAX


def check_name(path: os.PathLike) -> None:
    """Raise ``OSError(ENAMETOOLONG)`` naming ``path`` when one of its components is longer than its
    file system allows (a name checked before any long work, so that the write at the end does not
    fail); shorter names pass whether or not they exist."""
    path = Path(path)
    limit = name_max(path.parent)
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            raise OSError(errno.ENAMETOOLONG, f"a name of {len(os.fsencode(part))} bytes, longer than the "
                          f"{limit} a file name may have", str(path))


def temp_name(path: Path, tail: str = ".tmp") -> Path:
    """A hidden, unique temp name beside ``path``: ``.NAME.PID.RAND.tmp``, with ``NAME`` shortened
    (at a character boundary) so that the whole fits in a file name however long ``path``'s is."""
    unique = f".{os.getpid()}.{os.urandom(4).hex()}{tail}"
    room = max(1, name_max(path.parent) - len(os.fsencode(unique)) - 1)
    name = path.name
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return path.with_name(f".{name}{unique}")


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
    (e.g. the input's, for a file derived from it); default: the umask's. The temp name is
    shortened to fit (:func:`temp_name`); a ``path`` whose own name is too long is refused
    (``OSError(ENAMETOOLONG)``) before anything is written.
    """
    path = Path(path)
    check_name(path)
    tmp = temp_name(path)
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


def write_text(path: os.PathLike, text: str, **options) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_write` (``options`` are its keywords)."""
    with atomic_write(path, "w", **options) as fh:
        fh.write(text)


@contextmanager
def atomic_path(path: os.PathLike) -> Iterator[Path]:
    """A hidden temp path beside ``path`` for a library that writes a file by name (a profiler's
    trace), moved onto ``path`` on a clean exit and removed otherwise. It ends in ``path``'s endings
    (``.tmp.json.gz``), so a writer that picks its format by the name's ending picks the same."""
    path = Path(path)
    check_name(path)
    suffix = "".join(path.suffixes[-2:]) if len(os.fsencode("".join(path.suffixes[-2:]))) < 32 else ""
    tmp = temp_name(path, ".tmp" + suffix)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def copy_file(src: os.PathLike, dst: os.PathLike) -> None:
    """Copy the file ``src`` to ``dst`` through :func:`atomic_write`, with ``src``'s permission bits
    and times (as ``shutil.copy2`` keeps them)."""
    import shutil

    st = os.stat(src)
    with atomic_write(dst, file_mode=st.st_mode) as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def touch(path: os.PathLike) -> None:
    """Set ``path``'s times to now, creating it empty if need be (a heartbeat)."""
    Path(path).touch()


def append_line(path: os.PathLike, line: str, sync: bool = True) -> None:
    """Append ``line`` and a newline to the file at ``path`` (created if need be) in one write, then
    (``sync``) fsync it: a log or a record of lines, where a reader may see a torn last line (and
    skips it) but never loses an earlier one. Only a regular file is appended to: a FIFO, a device
    or a folder at ``path`` raises :class:`NotRegularFile` (opened without blocking: a FIFO with no
    reader is never waited for)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader; a folder
            regular_file(path)
        raise
    with os.fdopen(fd, "a") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file", str(path))
        fh.write(line + "\n")
        fh.flush()
        if sync:
            os.fsync(fh.fileno())


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
