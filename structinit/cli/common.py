"""What every command shares: the options declared once (``Annotated`` aliases, the same flag
meaning the same thing everywhere), the one place that turns errors into an ``error:`` line and an
exit code, JSON output, and the progress reporter (a rich bar on a terminal, plain lines in logs).
"""

from __future__ import annotations

import errno
import functools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import typer
from typing_extensions import Annotated

from structinit.errors import SYNTAX, StructinitError, Syntax
from structinit.runtime import duration_text
from structinit.solver.recipes import RECIPE_DEFAULTS

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

# --------------------------------------------------------------------------- shared options

def shown(value: Any) -> str:
    """A library default as a command's help shows it (``0.3``, ``10000``, ``1e-4``, ``1``): help
    reads the default from where the library declares it, never a copy typed by hand."""
    if isinstance(value, float) and value and abs(value) < 1e-3:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def path_arg(text) -> Path:
    """A path option's value: an empty one is an error, not the current folder (``Path("")`` is ``.``)."""
    if isinstance(text, Path):
        return text
    if not str(text).strip():
        raise typer.BadParameter("needs a name (an empty value would mean the current folder)")
    return Path(text)


#: The options whose declaration is more than their long flag, declared once: their names (the long
#: flag, its short letter, another long name) and, for a path, how its value is read (:func:`path_arg`,
#: which refuses an empty one). Any other option is its long flag alone. A command takes an option
#: through :func:`option`, with the help, default shown and bounds that are its own.
FLAGS: Dict[str, Dict[str, Any]] = {
    "--batch-size": {"names": ("--batch-size", "-b")},
    "--cache-dir": {"names": ("--cache-dir",), "parser": path_arg, "metavar": "DIR"},
    "--data-dir": {"names": ("--data-dir",), "parser": path_arg, "metavar": "DIR"},
    "--epochs": {"names": ("--epochs", "-e")},
    "--filter": {"names": ("--filter", "-f")},
    "--init-param": {"names": ("--init-param", "-p")},
    "--out": {"names": ("--out", "-o"), "parser": path_arg},
    "--profile": {"names": ("--profile",), "parser": path_arg},
    "--recipe": {"names": ("--recipe", "-r")},
    "--report-dir": {"names": ("--report-dir",), "parser": path_arg},
    "--tokens": {"names": ("--tokens", "-n")},
    "--verbose": {"names": ("--verbose", "-v")},
}
#: Short flags: each letter stands for one long option in every command that has it.
SHORT_FLAGS = {name: long for long, decl in FLAGS.items() for name in decl["names"] if not name.startswith("--")}


def option(flag: str, also: Tuple[str, ...] = (), **own: Any) -> Any:
    """The ``typer.Option`` of long flag ``flag`` as :data:`FLAGS` declares it (its names, its parser;
    a flag not there is its name alone), with
    what is this command's own (``help``, ``show_default``, ``min``, ``metavar``); ``also``: more long
    names the command gives it."""
    if not flag.startswith("--") or any(not name.startswith("--") for name in also):
        raise ValueError(f"option {flag!r}: a command names an option by its long flag; a short letter is "
                         "declared once, in FLAGS")
    decl = FLAGS.get(flag) or {"names": (flag,)}
    how = {k: v for k, v in decl.items() if k != "names"}
    return typer.Option(*decl["names"][:1], *also, *decl["names"][1:], **{**how, **own})


JsonOut = Annotated[bool, option("--json", help="Print one JSON document on stdout (for scripts).")]
Threads = Annotated[Optional[int], option(
    "--threads", min=1, help="torch CPU threads. The default takes $OMP_NUM_THREADS, else the idle cores of "
    "this machine less one (at least 1), shared among torchrun's processes.", show_default="auto")]
Device = Annotated[str, option("--device", help="auto, cpu, cuda or cuda:N.")]
CacheDir = Annotated[Optional[Path], option(
    "--cache-dir", help="Artifact cache folder.", show_default="$STRUCTINIT_CACHE, else $XDG_CACHE_HOME/structinit",
    metavar="DIR")]
def seed_option(of: str, when: str = "", **own: Any) -> Any:
    """``--seed`` as every command takes it: a non-negative integer, the seed of ``of`` (what this
    command draws with it); ``when``: the condition it applies under (``"--data with a preset: "``)."""
    return option("--seed", min=0, help=f"{when}{'S' if not when else 's'}eed of {of}.", **own)


Seed = Annotated[int, seed_option("offsets, noise and random draws")]

#: Where datasets are read from when ``--data-dir`` is not given (the library's ``default_data_dir``).
DATA_DIR_DEFAULT = "$STRUCTINIT_DATA, else ./data"


def data_dir_option(when: str = "", own: str = "", first: str = "") -> Any:
    """``--data-dir`` as every command takes it, its help written once: the folder a dataset's files
    are read from, by default :data:`DATA_DIR_DEFAULT`. ``when``: the condition it applies under
    (``"--data: "``); ``own``: a sentence of this command's; ``first``: where this command looks
    before the default (``"a run's own, else "``)."""
    return option("--data-dir", help=f"{when}{'T' if not when else 't'}he folder a dataset's files are read from "
                  f"(torchvision's formats; imagefolder: train/ and val/, a folder per class).{own}",
                  show_default=f"{first}{DATA_DIR_DEFAULT}")
InitParam = Annotated[List[str], option("--init-param", help="Init parameter NAME=VALUE (repeatable), "
                                              "e.g. -p position_subspace=true.", show_default=False)]
Tokens = Annotated[Optional[int], option("--tokens", help="Tokens N of a square grid (a perfect square).",
                                               show_default="256 when --grid is not given")]
GridOpt = Annotated[Optional[str], option("--grid", help="Token grid: HxW (an image) or L (a sequence of L "
                                                              "tokens).")]
Dim = Annotated[int, option("--dim", help="Embedding dimension D (divisible by heads, and by 4 on 2-D grids).")]
Heads = Annotated[int, option("--heads", help="Attention heads per layer.")]
Depth = Annotated[int, option("--depth", also=('--layers',),
                                    help="Attention layers, each with its own offsets and solve.")]
Filter = Annotated[int, option("--filter", help="Impulse filter size f (offsets from the f x f window; "
                                                            "on a sequence, from f positions).")]
Recipe = Annotated[str, option("--recipe", help="Solver recipe: fast, paper, released, closed-form or "
                                                       "authors-2025.")]
TargetMass = Annotated[Optional[float], option(
    "--target-mass", help="fast recipe: mean attention on the target token, in (1/N, 1); lower is softer.",
    show_default=shown(RECIPE_DEFAULTS["fast"]["target_mass"]))]
Offsets = Annotated[str, option("--offsets", help="Offset order: random (a draw per head) or centre "
                                                        "(centre first: 4,1,5,3,7,... for f=3).")]
Padding = Annotated[str, option("--padding", help="zero (the paper's) or circular (wrap-around).")]
Causal = Annotated[bool, option("--causal", help="Sequences: offsets only in the past (the current and f-1 "
                                                       "earlier tokens), for a decoder's causal mask.")]
Share = Annotated[bool, option("--share", help="Solve once and reuse it for every layer (the released code's "
                                                     "default).")]
Out = Annotated[Optional[Path], option("--out", help="Where to write.", metavar="PATH")]
Force = Annotated[bool, option("--force", help="Overwrite an existing output.")]

def examples(*lines: str) -> str:
    """A help epilog of example command lines, printed verbatim (Click's ``\\b`` marker keeps it
    from being rewrapped, so every line can be copied as it is)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


#: Library parameter names that a command spells with another flag (see :func:`flag_for`).
FLAG_ALIASES: Dict[str, str] = {"offset_order": "--offsets", "layers": "--layers", "init_params": "--init-param",
                                "recipe_params": "--recipe-param", "filter_size": "--filter"}


def listed(names: List[str], last: str = "or") -> str:
    """``names`` as a sentence lists them: ``a, b or c``."""
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else "".join(names)


def init_methods(last: str = "or") -> str:
    """The registered init methods, in the registry's order, as a help text lists them (read from
    the registry, so a method registered there, or through the ``structinit.inits`` entry point,
    is listed everywhere)."""
    from structinit.init.registry import INIT_METHODS

    return listed(list(INIT_METHODS), last)


#: Where a command's help sends the user for each method's parameters (``-p NAME=VALUE``).
PARAMS_LISTED = ("the built-in methods' parameters are listed in docs/init-methods.md, and an unknown NAME is "
                 "refused with the method's own list")


def flag_for(name: str, command_flags: List[str], aliases: Optional[Dict[str, str]] = None) -> str:
    """How the CLI names library parameter ``name``: the command's own ``--name`` flag (or its alias)
    when it has one, else the plain name (e.g. an ``--init-param`` key)."""
    alias = (aliases or {}).get(name)
    if alias and " " in alias and alias.split()[0] in command_flags:  # a phrase: --set download=true
        return alias
    for candidate in (alias, FLAG_ALIASES.get(name), "--" + name.replace("_", "-")):
        if candidate and candidate in command_flags:
            return candidate
    return name


def declared_flags(fn: Callable) -> List[str]:
    """The long flags (``--name``) a command function declares through ``typer.Option``."""
    import typing

    hints = typing.get_type_hints(fn, include_extras=True)
    flags = []
    for name in hints:
        for info in typing.get_args(hints[name])[1:]:
            # Inside Annotated, typer.Option's first argument (``default``) is the first flag.
            decls = [getattr(info, "default", None), *(getattr(info, "param_decls", ()) or ())]
            for decl in (d for d in decls if isinstance(d, str) and d.startswith("--")):
                flags += decl.split("/")  # a switch: --name/--no-name is both its flags
    return flags


class CommandSyntax(Syntax):
    """How a command names a library parameter (its own flag, :func:`flag_for`) and writes a setting:
    ``--flag VALUE`` (``--flag``/``--no-flag`` for a switch) where it has the flag, else
    ``-p NAME=VALUE`` where it takes init parameters, else ``NAME=VALUE``."""

    def __init__(self, flags: List[str], aliases: Optional[Dict[str, str]] = None):
        self.flags, self.aliases = flags, aliases

    def __call__(self, name: str) -> str:
        return flag_for(name, self.flags, self.aliases)

    def setting(self, name: str, value: Any) -> str:
        flag = self(name)
        text = json.dumps(value) if not isinstance(value, str) else value
        if flag.startswith("--") and " " not in flag:
            if isinstance(value, bool):
                off = "--no-" + flag[2:]
                return flag if value else off
            return f"{flag} {text}"
        if "--init-param" in self.flags:
            return f"-p {shlex.quote(f'{name}={text}')}"
        return shlex.quote(f"{name}={text}")


#: How the running command names a library parameter (its :class:`CommandSyntax`); ``None`` outside one.
FLAG_NAMER = SYNTAX


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one ``error:`` line on stderr and return an exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


#: Parameters whose text value is a path (a ``Path``-typed one always is): checked before any work.
PATH_PARAMS = ("data", "png", "target", "artifact", "runs_csv", "config")


def check_paths(values: Dict[str, Any], names: Tuple[str, ...] = PATH_PARAMS,
                flag_of: Callable[[str], str] = lambda n: "--" + n.replace("_", "-")) -> None:
    """Refuse, before any work, a path among ``values`` (a command's parameters: every ``Path``, and
    the text of those in ``names``) that no file could have: a name longer than the file system
    allows, a loop of symbolic links, or a symbolic link to nothing. Raises
    :class:`~structinit.errors.UsageError` naming the parameter by its flag (``flag_of``; an
    argument, which has none, by its path alone); a missing path passes: it may be an output, or a
    dataset's name."""
    import os

    from structinit.atomic import check_name
    from structinit.errors import UsageError, path_error

    for name, value in values.items():
        flag = flag_of(name)
        what = flag if flag.startswith("--") else ""
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if not (isinstance(item, Path) or (name in names and isinstance(item, str) and item)):
                continue
            try:
                check_name(Path(item))
                os.stat(item)
            except FileNotFoundError:
                if os.path.islink(item):  # neither read from nor written through: the link is the user's
                    text = f"{item}: a symbolic link to {os.readlink(item)}, which does not exist"
                    raise UsageError(f"{what} {text}" if what else text) from None
            except OSError as exc:
                if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):
                    raise path_error(exc, what) from None


def handle_errors(fn: Callable, aliases: Optional[Dict[str, str]] = None,
                  paths: Tuple[str, ...] = ()) -> Callable:
    """Wrap a command so that library errors become one ``error:`` line naming the command's flags,
    with the error's exit code (2 for usage errors and for a path that names nothing usable, see
    :func:`structinit.errors.path_error`; 1 for a file that cannot be read or written); Ctrl-C
    exits 130. Its path parameters (:func:`check_paths`, with ``paths`` as more of them) are
    checked before it runs."""

    flags = declared_flags(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from structinit.errors import path_error

        syntax = CommandSyntax(flags, aliases)
        token = FLAG_NAMER.set(syntax)  # warnings name this command's flags too
        try:
            check_paths(kwargs, PATH_PARAMS + paths, syntax)
            return fn(*args, **kwargs)
        except StructinitError as exc:
            raise fail(exc.render(syntax), exc.exit_code) from None
        except OSError as exc:  # a path the command did not check itself: one line, the rule's code
            err = path_error(exc)
            raise fail(err.render(syntax), err.exit_code) from None
        except RuntimeError as exc:
            if not str(exc).startswith("Symlink loop"):  # pathlib's resolve() on a loop (Python < 3.13)
                raise
            raise fail(f"{str(exc).split(' from ', 1)[-1]}: a loop of symbolic links", 2) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except MemoryError:
            raise fail("out of memory; try a smaller shape or --device cuda", 1) from None
        finally:
            FLAG_NAMER.reset(token)

    return wrapper


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout (NumPy values converted)."""
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=_json_default))


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def is_tty() -> bool:
    return sys.stderr.isatty()


# --------------------------------------------------------------------------- progress

class Progress:
    """Progress of long work on stderr: a rich bar on a terminal; elsewhere (cluster logs) a plain
    line every 10% of the work or every ``every`` seconds, whichever comes first, once the work has
    taken ``quiet`` seconds (so quick commands print their result alone, and a quick failure its
    one ``error:`` line). A 10% line comes at least :attr:`MIN_GAP` seconds after the line before
    it (work that runs through its tenths in a blink, such as writing a model's layers, prints no
    line per tenth), and says the time left only where it is half a second or more.

    Use as a context manager; :meth:`update` takes ``(done, total)`` (and a new label), :meth:`stage`
    names a new stage, :meth:`log` prints a line above the bar. ``enabled=False`` makes every call a
    no-op; ``plain=False`` keeps :meth:`update` silent off a terminal (where :meth:`log` lines
    already tell the progress).
    """

    #: The least seconds between a plain line and a 10% line after it.
    MIN_GAP = 1.0

    def __init__(self, label: str, enabled: bool = True, every: float = 30.0, transient: bool = True,
                 plain: bool = True, quiet: float = 2.0):
        self.label, self.enabled, self.every, self.transient, self.plain = label, enabled, every, transient, plain
        self.quiet = quiet
        self._bar: Optional[RichProgress] = None  # a rich bar and its task, on a terminal (both set or neither)
        self._task: Optional[TaskID] = None
        self._start = self._last_time = time.monotonic()
        self._last_tenth = -1
        self._first: Optional[tuple] = None

    def __enter__(self) -> "Progress":
        if self.enabled and is_tty():
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                     TimeRemainingColumn(), transient=self.transient)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=None)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, done: float, total: int, label: Optional[str] = None) -> None:
        """``done`` of ``total`` (``done`` may be fractional: 2.4 runs of 10, shown to a tenth)."""
        if not self.enabled:
            return
        if label and label != self.label:
            self.label = label
            self._first = None  # a new stage: its rate is measured afresh
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=_count(done), total=total, description=self.label)
            return
        if not self.plain:
            return
        now = time.monotonic()
        if self._first is None or done < self._first[1]:
            self._first = (now, done)  # the rate is measured from here: start-up is not work
        if now - self._start < self.quiet:
            return
        tenth = int(10 * done / max(total, 1))
        since = now - self._last_time
        if (tenth != self._last_tenth and since >= self.MIN_GAP) or since >= self.every:
            elapsed = now - self._start
            t1, d1 = self._first
            eta = (now - t1) / (done - d1) * (total - done) if d1 < done < total else 0.0
            left = f", about {duration_text(eta)} left" if eta >= 0.5 else ""
            print(f"{self.label}: {_count(done)}/{total} ({elapsed:.1f}s{left})", file=sys.stderr, flush=True)
            self._last_tenth, self._last_time = tenth, now

    def stage(self, label: str) -> None:
        """A new stage of the work: the bar's label on a terminal, one plain line elsewhere."""
        if not self.enabled:
            return
        self.label = label
        self._first = None  # a new stage: its rate is measured afresh
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=label)
        elif self.plain and time.monotonic() - self._start >= self.quiet:
            print(f"{label} ({time.monotonic() - self._start:.1f}s)", file=sys.stderr, flush=True)
            self._last_time = time.monotonic()

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)

    def __call__(self, done: float, total: int) -> None:
        """So that a :class:`Progress` can be passed where a ``progress(done, total)`` callback is taken."""
        self.update(done, total)


def _count(done: float) -> float:
    """A count as a progress line shows it: whole as it is, a fraction to a tenth (``2.4``)."""
    return int(done) if float(done).is_integer() else round(float(done), 1)
