"""What ``bench grid``, ``bench report`` and ``bench run`` share: their options, declared once, the
library parameter names they spell with another flag, which flags a command line gave, and the
``bench grid`` command line that launches (and so continues) a grid."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import typer
from typing_extensions import Annotated

from structinit.cli.common import data_dir_option, option

Sets = Annotated[List[str], option("--set", help="Change a training setting for every run: NAME=VALUE (repeatable), "
                                "e.g. epochs=1 or device=cuda; init_params.NAME=VALUE changes the runs whose init "
                                "method takes NAME.")]
Seeds = Annotated[Optional[str], option("--seeds", help="Seeds: a count N (seeds 0..N-1), a list such as 0,3,7, or a "
                                     "range such as 5-9 (one seed alone: 7,).",
                                     show_default="the grid's")]
Only = Annotated[List[str], option("--only", help="Keep only some values of an axis: AXIS=ID[,ID...] (repeatable), "
                                "e.g. train_size=100,250.")]
RunsDir = Annotated[Path, option("--out", help="Where the runs live: one folder per run, named by its key.",
                                 metavar="DIR")]
Yes = Annotated[bool, option("--yes", help="Expand a grid of more than 10,000 runs (refused without it: expanding "
                                     "alone takes minutes to hours).")]
DataDir = Annotated[Optional[Path], data_dir_option(own=" Every run reads its dataset from here; a grid's relative "
                                                    "data_dir is read below it.")]

#: Library parameter names that the bench commands spell with another flag.
ALIASES = {"overrides": "--set", "only": "--only", "time": "--time", "seeds": "--seeds",
           "attention_column": "--attention-column", "yes": "--yes", "data_dir": "--data-dir",
           "download": "--set download=true"}


def given_flags(ctx: typer.Context, names: Dict[str, str]) -> List[str]:
    """The flags among ``names`` (parameter -> flag) given on the command line."""
    out = []
    for name, flag in names.items():
        source = ctx.get_parameter_source(name)
        # compared by name: newer Typer releases vendor their own copy of click's ParameterSource
        if source is not None and getattr(source, "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP"):
            out.append(flag)
    return out


def grid_command(grid: str, out: Path, overrides: Sequence[str], seeds: Optional[str], data_dir: Optional[Path],
                 only: Sequence[str] = ()) -> str:
    """The ``structinit bench grid`` command line (shell-quoted) that launches ``grid`` with these
    options: recorded in the grid's manifest, and what a report or a job script says to run again."""
    import shlex

    args = ["structinit", "bench", "grid", grid, "--out", str(out)]
    for item in only:
        args += ["--only", item]
    if seeds is not None:
        args += ["--seeds", seeds]
    for item in overrides:
        args += ["--set", item]
    if data_dir is not None:
        args += ["--data-dir", str(data_dir)]
    return shlex.join(args)
