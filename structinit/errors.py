"""Errors that the CLI turns into one line on stderr and a non-zero exit code.

Library messages name the parameter at fault (``dim must be divisible by heads``); the CLI shows
the same message with its own flag (``--dim must be ...``). A message marks a parameter name with
:func:`param`, e.g. ``UsageError(f"{param('dim')} must be positive, got {dim}")``; ``str(error)``
renders the library name, :meth:`StructinitError.render` any other.
"""

from __future__ import annotations

import contextvars
import errno
import json
import os
import re
from typing import Any, Callable, Dict, Optional

_MARK = "\x1f"
_MARKED = re.compile(_MARK + r"([A-Za-z0-9_.\-]+)" + _MARK)
_SET = "\x1e"
_SETTING = re.compile(_SET + r"([A-Za-z0-9_.\-]+)" + _SET + r"([^\x1e]*)" + _SET)


def param(name: str) -> str:
    """Mark ``name`` as a parameter name inside an error message (see the module docstring)."""
    return f"{_MARK}{name}{_MARK}"


def setting(name: str, value: Any) -> str:
    """Mark parameter ``name`` set to ``value`` (a bool, number or string) inside a message: advice
    the caller can act on, written in the caller's syntax when rendered (:class:`Syntax`): a keyword
    argument from Python (``position_subspace=True``), a flag on the command line
    (``-p position_subspace=true``, ``--data-fit 1000``), a key in a grid file."""
    return f"{_SET}{name}{_SET}{json.dumps(value)}{_SET}"


def nest_settings(text: str, name: str, base: Dict[str, Any]) -> str:
    """``text`` with every marked setting ``key=value`` (:func:`setting`) moved inside the dict
    parameter ``name``: ``name={**base, key: value}`` (advice of a part that another method's
    parameter configures, e.g. a mixed init's ``lower_params``)."""

    def nested(m: "re.Match[str]") -> str:
        return setting(name, {**base, m.group(1): json.loads(m.group(2))})

    return _SETTING.sub(nested, text)


class Syntax:
    """How a caller writes a parameter's name (``syntax(name)``) and a setting (:meth:`setting`):
    Python's, the library's keyword arguments, by default. The CLI and the grid runner give their own
    (:data:`SYNTAX` holds the one in force)."""

    def __call__(self, name: str) -> str:
        return name

    def setting(self, name: str, value: Any) -> str:
        """``name`` set to ``value`` (a JSON value) as this caller writes it."""
        return f"{self(name)}={value!r}"


#: The syntax of whoever runs the library now (the CLI's command, a grid's task); ``None``: Python's.
SYNTAX: contextvars.ContextVar[Optional[Callable[[str], str]]] = contextvars.ContextVar("SYNTAX", default=None)


def _render(exc: BaseException, name_of: Optional[Callable[[str], str]]) -> str:
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    namer = name_of or Syntax()

    def one_setting(m: "re.Match[str]") -> str:
        value = json.loads(m.group(2))
        if hasattr(namer, "setting"):
            return namer.setting(m.group(1), value)
        return f"{namer(m.group(1))}={json.dumps(value) if not isinstance(value, str) else value}"

    return _MARKED.sub(lambda m: namer(m.group(1)), _SETTING.sub(one_setting, text))


class StructinitError(Exception):
    """A problem the user can fix; ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def render(self, name_of: Optional[Callable[[str], str]] = None) -> str:
        """The message with every marked parameter written as ``name_of(name)`` (default: the name)."""
        return _render(self, name_of)

    def __str__(self) -> str:
        return self.render()


class StructinitWarning(UserWarning):
    """Something the library did other than asked for or expected (marked parameters as in errors)."""

    def render(self, name_of: Optional[Callable[[str], str]] = None) -> str:
        """The message with every marked parameter written as ``name_of(name)`` (default: the name)."""
        return _render(self, name_of)

    def __str__(self) -> str:
        return self.render()


class UsageError(StructinitError, ValueError):
    """Impossible or inconsistent settings (CLI exit code 2)."""

    exit_code = 2


#: ``errno`` values that say a path names nothing usable as asked (missing, a loop of symbolic links,
#: a name too long, a folder for a file or a file for a folder): bad input, exit code 2, like a bad
#: flag. Any other ``OSError`` (permission denied, an I/O error, a full or read-only disk) exits 1.
PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP})


def path_error(exc: OSError, what: str = "") -> StructinitError:
    """``exc`` as one line naming its path (``what``: the parameter or words to put first), of the
    class that gives the exit code of the rule: :class:`UsageError` (2) for a path that names
    nothing usable as asked (:data:`PATH_ERRNOS`, or a FIFO, device or folder where a file is read:
    :class:`structinit.atomic.NotRegularFile`), :class:`StructinitError` (1) for a file that is
    there but cannot be read or written, and for a problem of the system."""
    name = exc.filename if exc.filename is not None else ""
    words = exc.strerror or str(exc)
    if exc.errno == errno.ENAMETOOLONG and "bytes" not in words:
        longest = max((len(os.fsencode(p)) for p in str(name).split(os.sep)), default=0)
        words = f"{words} (a name of {longest} bytes; a file name may have at most 255)"
    text = " ".join(t for t in (what, str(name)) if t)
    line = f"{text}: {words}" if text else words
    usage = exc.errno in PATH_ERRNOS or (type(exc).__name__ == "NotRegularFile" and exc.errno != errno.EFBIG)
    return UsageError(line) if usage else StructinitError(line)


class ArtifactError(StructinitError):
    """An artifact file that is missing, truncated, corrupt or of another format."""

    exit_code = 1


class ArtifactNotFound(ArtifactError):
    """An artifact path that names no regular file (nothing, a dangling link or a loop, a FIFO, a
    device): the caller's mistake, exit code 2 (see :func:`path_error`)."""

    exit_code = 2


class Notice(str):
    """A line for the user that a caller's ``log`` should show even where it shows progress quietly
    (the estimated time of long work, a wait for another process): a ``str`` marked as such."""
