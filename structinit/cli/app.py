"""The ``structinit`` command line: builds the Typer app from the command modules (which know
nothing of it) and runs it with one error convention: a problem with the input is one ``error:``
line on stderr and exit code 2, any other failure one line and exit code 1, Ctrl-C exit code 130.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from structinit import __version__
from structinit.cli import (
    apply,
    bench_exactness,
    bench_fit,
    bench_grid,
    bench_loop,
    bench_options,
    bench_report,
    bench_run,
    bench_solver,
    inspect,
    solve,
    train,
)
from structinit.cli.common import FLAG_NAMER, handle_errors, option

#: Warnings raised from files under this folder are the library's own.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

HELP = ("Convolutional structure for transformers through initialization alone: solve Q/K so that each "
        "attention head starts as an impulse filter, inject it into models and checkpoints, train and compare.\n\n"
        "Example: structinit solve --tokens 256 --dim 192 --heads 3 --filter 3")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"structinit {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    """The Typer app with every command registered."""
    app = typer.Typer(name="structinit", help=HELP, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                      pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})

    @app.callback()
    def _root(version: Annotated[bool, option("--version", callback=_version, is_eager=True,
                                              help="Print the version and exit.")] = False):
        """Convolutional structure for transformers through initialization alone."""

    app.command("solve", epilog=solve.EXAMPLES)(handle_errors(solve.solve, solve.ALIASES))
    app.command("inspect", epilog=inspect.EXAMPLES)(handle_errors(inspect.inspect, inspect.ALIASES))
    app.command("apply", epilog=apply.EXAMPLES)(handle_errors(apply.apply, apply.ALIASES))
    app.command("train", epilog=train.EXAMPLES)(handle_errors(train.train))
    bench_app = typer.Typer(help="Benchmarks (the solver recipes side by side, attention against a convolution, the "
                            "data fit's cost, the training loop's overhead) and the paper's comparison as training "
                            "grids (run locally or on SLURM) with their reports.", no_args_is_help=True,
                            rich_markup_mode=None)
    bench_app.command("solver", epilog=bench_solver.EXAMPLES)(handle_errors(bench_solver.bench_solver, solve.ALIASES))
    bench_app.command("exactness", epilog=bench_exactness.EXAMPLES)(handle_errors(bench_exactness.bench_exactness,
                                                                                  bench_exactness.ALIASES))
    bench_app.command("fit", epilog=bench_fit.EXAMPLES)(handle_errors(bench_fit.bench_fit, bench_fit.ALIASES))
    bench_app.command("loop", epilog=bench_loop.EXAMPLES)(handle_errors(bench_loop.bench_loop))
    grid_aliases = bench_options.ALIASES
    bench_app.command("grid", epilog=bench_grid.EXAMPLES)(handle_errors(bench_grid.bench_grid, grid_aliases,
                                                                        paths=("grid",)))
    bench_app.command("report", epilog=bench_report.EXAMPLES)(handle_errors(bench_report.bench_report, grid_aliases))
    bench_app.command("run", epilog=bench_run.EXAMPLES)(handle_errors(bench_run.bench_run, grid_aliases))
    app.add_typer(bench_app, name="bench")
    return app


app = build_app()


@functools.lru_cache(maxsize=None)
def click_command():
    """The Click command Typer builds from ``app``, built once: ``app(...)`` rebuilds it on every
    call (about 50 ms), which is most of the cost of an in-process call such as the tests make."""
    return typer.main.get_command(app)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit code. Usage errors that
    the parser finds (an unknown flag, a missing value) are one ``error:`` line too, with a hint."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            result = click_command().main(args=argv, prog_name="structinit", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        return 130
    except Exception as exc:  # the parser's own errors (Click's, vendored by newer Typer releases)
        if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            typer.echo(exc.format_message())
            return 2
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        return int(exc.exit_code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The library's own warnings (a :class:`~structinit.errors.StructinitWarning`, or raised from its
    code) as one ``warning:`` line on stderr; others as Python shows them."""
    from structinit.errors import StructinitWarning

    if issubclass(category, StructinitWarning) or PACKAGE_ROOT in Path(filename).resolve().parents:
        namer = FLAG_NAMER.get()
        text = message.render(namer) if namer is not None and hasattr(message, "render") else message
        typer.echo(f"warning: {text}", err=True)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run() -> None:
    """The console-script entry point (and ``python -m structinit``'s, which installed the stop
    handler of ``bench run`` and ``train`` before loading this module)."""
    from structinit.experiments.task import install_process_stopper

    install_process_stopper(sys.argv[1:])
    sys.exit(main())
