"""What every command shares: the options declared once (``Annotated`` aliases, the same flag
meaning the same thing everywhere), the one place that turns errors into an ``error:`` line and an
exit code, JSON output, and the progress reporter (a rich bar on a terminal, plain lines in logs).
"""

from __future__ import annotations

import contextvars
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.errors import StructinitError
from structinit.runtime import duration_text

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

# --------------------------------------------------------------------------- shared options

def path_arg(text) -> Path:
    """A path option's value: an empty one is an error, not the current folder (``Path("")`` is ``.``)."""
    if isinstance(text, Path):
        return text
    if not str(text).strip():
        raise typer.BadParameter("needs a name (an empty value would mean the current folder)")
    return Path(text)


# Short flags: each letter stands for one long option in every command that has it.
SHORT_FLAGS = {"-o": "--out", "-n": "--tokens", "-f": "--filter", "-r": "--recipe", "-e": "--epochs",
               "-b": "--batch-size", "-p": "--init-param", "-h": "--help", "-v": "--verbose"}

JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (for scripts).")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", min=1, help="torch CPU threads. The default takes $OMP_NUM_THREADS, else the idle cores of "
    "this machine less one (at least 1), shared among torchrun's processes.", show_default="auto")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
CacheDir = Annotated[Optional[Path], typer.Option(
    "--cache-dir", help="Artifact cache folder.", show_default="$STRUCTINIT_CACHE, else $XDG_CACHE_HOME/structinit",
    parser=path_arg, metavar="DIR")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seed of offsets, noise and random draws.")]
InitParam = Annotated[List[str], typer.Option("--init-param", "-p", help="Init parameter NAME=VALUE (repeatable), "
                                              "e.g. -p position_subspace=true.", show_default=False)]
Tokens = Annotated[Optional[int], typer.Option("--tokens", "-n", help="Tokens N of a square grid (a perfect square).",
                                               show_default="256 when --grid is not given")]
GridOpt = Annotated[Optional[str], typer.Option("--grid", help="Token grid: HxW (an image) or L (a sequence of L "
                                                              "tokens).")]
Dim = Annotated[int, typer.Option("--dim", help="Embedding dimension D (divisible by heads, and by 4 on 2-D grids).")]
Heads = Annotated[int, typer.Option("--heads", help="Attention heads per layer.")]
Depth = Annotated[int, typer.Option("--depth", "--layers",
                                    help="Attention layers, each with its own offsets and solve.")]
Filter = Annotated[int, typer.Option("--filter", "-f", help="Impulse filter size f (offsets from the f x f window; "
                                                            "on a sequence, from f positions).")]
Recipe = Annotated[str, typer.Option("--recipe", "-r", help="Solver recipe: fast, paper, released, closed-form or "
                                                       "authors-2025.")]
TargetMass = Annotated[Optional[float], typer.Option(
    "--target-mass", help="fast recipe: mean attention on the target token, in (1/N, 1); lower is softer.",
    show_default="0.3")]
Offsets = Annotated[str, typer.Option("--offsets", help="Offset order: random (a draw per head) or centre "
                                                        "(centre first: 4,1,5,3,7,... for f=3).")]
Padding = Annotated[str, typer.Option("--padding", help="zero (the paper's) or circular (wrap-around).")]
Causal = Annotated[bool, typer.Option("--causal", help="Sequences: offsets only in the past (the current and f-1 "
                                                       "earlier tokens), for a decoder's causal mask.")]
Share = Annotated[bool, typer.Option("--share", help="Solve once and reuse it for every layer (the released code's "
                                                     "default).")]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to write.", parser=path_arg, metavar="PATH")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]

def examples(*lines: str) -> str:
    """A help epilog of example command lines, printed verbatim (Click's ``\\b`` marker keeps it
    from being rewrapped, so every line can be copied as it is)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


#: Library parameter names that a command spells with another flag (see :func:`flag_for`).
FLAG_ALIASES: Dict[str, str] = {"offset_order": "--offsets", "layers": "--layers", "init_params": "--init-param",
                                "recipe_params": "--recipe-param", "filter_size": "--filter"}


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
            flags += [d for d in decls if isinstance(d, str) and d.startswith("--")]
    return flags


#: How the running command names a library parameter (``flag_for`` with its flags); ``None`` outside one.
FLAG_NAMER: contextvars.ContextVar[Optional[Callable[[str], str]]] = contextvars.ContextVar("FLAG_NAMER",
                                                                                          default=None)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one ``error:`` line on stderr and return an exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def handle_errors(fn: Callable, aliases: Optional[Dict[str, str]] = None) -> Callable:
    """Wrap a command so that library errors become one ``error:`` line naming the command's flags,
    with the error's exit code (2 for usage errors); Ctrl-C exits 130."""

    flags = declared_flags(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = FLAG_NAMER.set(lambda n: flag_for(n, flags, aliases))  # warnings name this command's flags too
        try:
            return fn(*args, **kwargs)
        except StructinitError as exc:
            raise fail(exc.render(lambda n: flag_for(n, flags, aliases)), exc.exit_code) from None
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
    one ``error:`` line).

    Use as a context manager; :meth:`update` takes ``(done, total)`` (and a new label), :meth:`stage`
    names a new stage, :meth:`log` prints a line above the bar. ``enabled=False`` makes every call a
    no-op; ``plain=False`` keeps :meth:`update` silent off a terminal (where :meth:`log` lines
    already tell the progress).
    """

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

    def update(self, done: int, total: int, label: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if label and label != self.label:
            self.label = label
            self._first = None  # a new stage: its rate is measured afresh
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=total, description=self.label)
            return
        if not self.plain:
            return
        now = time.monotonic()
        if self._first is None or done < self._first[1]:
            self._first = (now, done)  # the rate is measured from here: start-up is not work
        if now - self._start < self.quiet:
            return
        tenth = int(10 * done / max(total, 1))
        if tenth != self._last_tenth or now - self._last_time >= self.every:
            elapsed = now - self._start
            t1, d1 = self._first
            left = (f", about {duration_text((now - t1) / (done - d1) * (total - done))} left"
                    if d1 < done < total else "")
            print(f"{self.label}: {done}/{total} ({elapsed:.1f}s{left})", file=sys.stderr, flush=True)
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

    def __call__(self, done: int, total: int) -> None:
        """So that a :class:`Progress` can be passed where a ``progress(done, total)`` callback is taken."""
        self.update(done, total)
