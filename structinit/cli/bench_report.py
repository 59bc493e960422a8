"""``structinit bench report``: whatever runs of a grid have finished, as the paper's tables
(markdown, CSV, JSON) and figures (a thin layer over :mod:`structinit.experiments.report`,
:mod:`~structinit.experiments.output` and :mod:`~structinit.experiments.attention`)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.bench_options import Only, RunsDir, Seeds, Sets, Yes, given_flags, grid_command
from structinit.cli.common import JsonOut, Progress, emit_json, examples, option

EXAMPLES = examples(
    'structinit bench report runs                                   # every grid launched into ./runs',
    'structinit bench report digits --set epochs=1 --seeds 1 --only train_size=100 --only init=mimetic,impulse   '
    '# the runs of that expansion',
    'structinit bench report runs --report-dir report --attention  # + CSV, figures, attention after init',
    'structinit bench report runs --json',
)


def bench_report(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="A folder of runs (bench grid's --out), or a grid (name or file) "
                                          "whose runs are in --out.", show_default=False)],
    out: RunsDir = Path("runs"),
    overrides: Sets = [],  # noqa: B006
    seeds: Seeds = None,
    only: Only = [],  # noqa: B006
    grid_name: Annotated[Optional[str], option("--grid", help="With a folder: report only this grid.")] = None,
    report_dir: Annotated[Optional[Path], option("--report-dir", help="Write report.md, cells.csv, runs.csv, "
                                              "report.json and the figures (PNG) into this folder.",
                                              metavar="DIR")] = None,
    force: Annotated[bool, option("--force", help="Replace an earlier report in --report-dir whole: its files "
                               "that this one does not write (e.g. figures) are removed and named on "
                               "stderr.")] = False,
    figures: Annotated[bool, option("--figures/--no-figures", help="Draw the figures (with --report-dir).")] = True,
    attention: Annotated[bool, option("--attention", help="Also draw the attention after init averaged over real "
                                   "training images, first / middle / last layer, one column per method (with "
                                   "--report-dir).")] = False,
    attention_column: Annotated[Optional[str], option("--attention-column", help="The grid column whose models are "
                                                   "drawn, as value ids joined by '/'.",
                                                   show_default="the first")] = None,
    attention_images: Annotated[int, option("--attention-images", min=1, help="Training images to average "
                                         "over.")] = 64,
    runs_csv: Annotated[List[Path], option("--runs-csv", help="The runs.csv of an earlier report (repeatable): a run "
                                        "whose folder is not in --out (or not finished there) is taken from it by "
                                        "its run key, without its per-epoch curve. With a grid.")] = [],  # noqa: B006
    baseline: Annotated[Optional[str], option("--baseline", help="The row (init id) the differences are paired "
                                           "against. With a grid.", show_default="the grid's")] = None,
    mixed_versions: Annotated[bool, option("--mixed-versions", help="Pool the runs of a row even where they recorded "
                                        "different algorithm versions (refused otherwise).")] = False,
    yes: Yes = False,
    json_out: JsonOut = False,
):
    """Turn whatever runs have finished into the paper's tables (markdown, CSV, JSON) and figures.

    Final-epoch test accuracy is the headline (mean ± std over seeds, the seed count, the
    difference to the baseline paired by seed, the paper's number beside ours); unfinished cells
    are marked; the best epoch is shown as such, chosen on the validation split when there is one.
    """
    from structinit.errors import UsageError
    from structinit.experiments.report import markdown, reports_for_folder

    _refuse_idle_file_options(ctx, report_dir, figures, attention)
    folder = Path(target).expanduser()
    earlier: Dict[str, object] = {}
    if folder.is_dir():
        _refuse_grid_options(ctx, target, overrides, seeds, only, runs_csv, baseline, yes)
        reports = reports_for_folder(folder, grid_name, mixed_versions)
    else:
        if grid_name is not None:
            raise UsageError(f"--grid picks one grid of a folder of runs; {target} is a grid, so it would do nothing")
        earlier, reports = _grid_reports(target, out, overrides, seeds, only, runs_csv, baseline, mixed_versions, yes,
                                         json_out)
    if not earlier and not any(r.ex.run_dir(c).is_dir() for r in reports for c in r.ex.cells):
        raise UsageError(f"no runs of {target} in {reports[0].ex.runs_dir} yet; launch them with structinit bench "
                         "grid")
    att = _attention_figures(reports, attention_column, attention_images) if attention else None
    if report_dir is not None:
        _write_report_folder(reports, report_dir, figures, att, force, json_out)
    if json_out:
        emit_json({"grids": [r.to_dict() for r in reports]})
    elif report_dir is None:
        typer.echo("\n".join(markdown(r) for r in reports))


def _refuse_idle_file_options(ctx: typer.Context, report_dir: Optional[Path], figures: bool, attention: bool) -> None:
    """The options about the files --report-dir writes are errors without it, as are --attention's
    own without --attention."""
    from structinit.errors import UsageError

    if report_dir is None:
        extra = given_flags(ctx, {"force": "--force", "figures": "--figures/--no-figures", "attention": "--attention",
                                  "attention_column": "--attention-column", "attention_images": "--attention-images"})
        if extra:
            raise UsageError(f"{extra[0]} is about the files --report-dir writes; without --report-dir it would do "
                             "nothing")
    if not attention:
        extra = given_flags(ctx, {"attention_column": "--attention-column", "attention_images": "--attention-images"})
        if extra:
            raise UsageError(f"{extra[0]} chooses what --attention draws; without --attention it would do nothing")
    elif not figures:
        raise UsageError("--attention draws a figure, which --no-figures turns off; give one of them")


def _refuse_grid_options(ctx: typer.Context, target: str, overrides, seeds, only, runs_csv, baseline, yes) -> None:
    """With a folder of runs, the options that choose a grid's runs are errors: the folder's grids
    are reported as they were launched."""
    from structinit.errors import UsageError

    if overrides or seeds is not None or only or runs_csv or baseline:
        raise UsageError("--set, --seeds, --only, --runs-csv and --baseline apply to a grid; with a folder the "
                         "grids recorded in it are reported")
    if yes:
        raise UsageError("--yes lets a grid of many runs be expanded; a folder's grids were expanded when they "
                         "were launched, so it would do nothing")
    if given_flags(ctx, {"out": "--out"}):
        raise UsageError(f"--out says where a grid's runs are; {target} is itself the folder of runs reported, "
                         "so --out would do nothing")


def _grid_reports(target: str, out: Path, overrides, seeds, only, runs_csv, baseline, mixed_versions: bool,
                  yes: bool, json_out: bool):
    """``(earlier, [report])`` of a grid (name or file) whose runs are in ``out``: the grid expanded
    as ``bench grid`` expands it, with ``--baseline`` in place of its own, and ``earlier`` the runs
    read from the ``--runs-csv`` files (by run key)."""
    import dataclasses

    from structinit.errors import UsageError
    from structinit.experiments.expand import MAX_RUNS, expand
    from structinit.experiments.gridspec import load_grid
    from structinit.experiments.report import collect, read_runs_csv

    spec = load_grid(target)
    if baseline is not None:
        rows = [v.id for v in spec.row_axis.values]
        if baseline not in rows:
            raise UsageError(f"--baseline {baseline!r} is not a row of {spec.name}; its rows are {', '.join(rows)}")
        spec = dataclasses.replace(spec, baseline=baseline)
    earlier = {}
    for path in runs_csv:
        earlier.update(read_runs_csv(path))
    with Progress("expanding the grid", enabled=not json_out) as bar:
        ex = expand(spec, overrides=overrides, seeds=seeds, runs_dir=out, only=only,
                    command=grid_command(target, out, overrides, seeds, None, only),
                    max_runs=None if yes else MAX_RUNS, progress=bar.update)
    if not out.is_dir() and not earlier:
        raise UsageError(f"no runs: {out} does not exist (launch the grid with structinit bench grid {target} "
                         f"--out {out})")
    return earlier, [collect(ex, earlier, mixed_versions)]


def _attention_figures(reports, column: Optional[str], images: int) -> Dict[str, tuple]:
    """``--attention``: per report, ``(figure, entries)`` of its models' attention after init on
    ``images`` real training images (the column ``column``, value ids joined by '/')."""
    from structinit.analysis.figures import save_png  # noqa: F401  (matplotlib is needed)
    from structinit.experiments.attention import attention_grid_figure, column_arg, grid_attention

    att = {}
    for rep in reports:
        entries = grid_attention(rep.ex, column=column_arg(column), images=images)
        att[rep.name] = (attention_grid_figure(entries, title=rep.spec.title), entries)
    return att


def _write_report_folder(reports, report_dir: Path, figures: bool, attention, force: bool, json_out: bool) -> None:
    """``--report-dir``: report.md, the CSVs, report.json and the figures, all or nothing; with
    ``force`` the earlier report's files this one does not write are removed, and named on stderr."""
    from structinit.experiments.output import render_report, stale_report_files, write_report

    files = render_report(reports, figures=figures, attention=attention)
    replaced = stale_report_files(files, report_dir) if force else []
    written = write_report(files, report_dir, force=force)
    if not json_out:
        typer.echo(f"wrote {len(written)} files into {report_dir}: {', '.join(p.name for p in written)}")
    if replaced:  # said on stderr, so that --json stays parseable
        hint = " (--attention draws the attention figure again)" if any(n.endswith("-attention.png")
                                                                          for n in replaced) else ""
        typer.echo(f"removed {len(replaced)} files of the earlier report that this one does not write: "
                   f"{', '.join(replaced)}{hint}", err=True)
