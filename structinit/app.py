"""The ``structinit`` command line: a thin layer over the library (see each command's module)."""

from __future__ import annotations

import typer

from . import __version__

app = typer.Typer(
    name="structinit",
    help="Convolutional structure for Vision Transformers through initialization alone.\n\n"
    "Example: structinit solve --tokens 256 --dim 192 --heads 3 --filter 3",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"structinit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version.")):
    """Convolutional structure for Vision Transformers through initialization alone."""


def _register() -> None:
    # Each module adds its commands to ``app``; they import torch/timm only inside command bodies.
    from .commands import apply, bench, inspect, solve, train  # noqa: F401


def main() -> None:
    _register()
    app()


