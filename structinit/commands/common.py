"""Shared CLI plumbing: error reporting, JSON output, progress that degrades to plain lines."""

from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import typer

from ..errors import StructinitError


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one ``error:`` line on stderr and return an exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def cli_errors(fn: Callable) -> Callable:
    """Turn library errors into one clear stderr line and an exit code (2 for usage errors)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StructinitError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except MemoryError:
            raise fail("out of memory; try a smaller shape or --device cuda", 1) from None

    return wrapper


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout (for scripts)."""
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=_default))


def _default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


def is_tty() -> bool:
    return sys.stderr.isatty()


@contextmanager
def progress(label: str, enabled: bool = True) -> Iterator[Optional[Callable[[int, int], None]]]:
    """A ``callback(done, total)`` that drives a rich progress bar on a terminal, or prints a plain
    line to stderr every 10% (cluster logs). Yields ``None`` when disabled."""
    if not enabled:
        yield None
        return
    if is_tty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task(label, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            yield update
        return
    start = time.monotonic()
    last = [-1]

    def plain(done: int, total: int) -> None:
        tenth = int(10 * done / max(total, 1))
        if tenth != last[0]:
            last[0] = tenth
            print(f"{label}: {done}/{total} ({time.monotonic() - start:.1f}s)", file=sys.stderr, flush=True)

    yield plain
