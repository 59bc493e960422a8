"""``structinit bench grid``: run the comparison of a grid, every cell and seed a training run, on
this machine, as a SLURM job array or as printed commands (a thin layer over
:mod:`structinit.experiments`: :func:`~structinit.experiments.expand.expand`, then
:mod:`~structinit.experiments.launch` or :mod:`~structinit.experiments.slurm`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.bench_options import (
    ALIASES,
    DataDir,
    Only,
    RunsDir,
    Seeds,
    Sets,
    Yes,
    given_flags,
    grid_command,
)
from structinit.cli.common import JsonOut, Progress, Threads, emit_json, examples, option

EXAMPLES = examples(
    'structinit bench grid --list                                   # the shipped grids and their run counts',
    'structinit bench grid digits --jobs 2                          # the digits learning curve on this machine',
    'structinit bench grid digits --set epochs=1 --seeds 1 --only train_size=100 --only init=mimetic,impulse '
    '--jobs 2   # a quick reduced run',
    'structinit bench grid digits --status                          # finished / running / failed / pending',
    'structinit bench grid table2 --data-dir ~/data --launcher slurm --partition gpu --gpus 1 --cpus 8 '
    '--time 12:00:00 --max-concurrent 16',
    'structinit bench grid my-grid.toml --launcher print > commands.txt',
)

#: bench grid's own options: what to do instead of launching, and how to launch.
GridArg = Annotated[Optional[str], typer.Argument(help="A shipped grid (see --list) or a grid file (.toml).",
                                                  show_default=False)]
ListGrids = Annotated[bool, option("--list", help="List the shipped grids with their run counts.")]
Status = Annotated[bool, option("--status", help="Say how many runs are finished, running, failed (with the last line "
                             "of their log) and pending; launch nothing.")]
Launcher = Annotated[str, option("--launcher", help="local (this machine), slurm (a job array) or print (the commands, "
                              "for any other scheduler).")]
Jobs = Annotated[int, option("--jobs", min=1, help="local: runs at once (CPU threads are divided between them).")]
Partition = Annotated[Optional[str], option("--partition", help="slurm: partition.")]
TimeLimit = Annotated[Optional[str], option("--time", help="slurm: time limit per task (HH:MM:SS or D-HH:MM:SS).")]
Gpus = Annotated[int, option("--gpus", min=0, help="slurm: GPUs per task (more than one: torchrun).")]
Cpus = Annotated[Optional[int], option("--cpus", min=1, help="slurm: CPUs per task.")]
Mem = Annotated[Optional[str], option("--mem", help="slurm: memory per task, e.g. 32G.")]
Account = Annotated[Optional[str], option("--account", help="slurm: account.")]
Qos = Annotated[Optional[str], option("--qos", help="slurm: quality of service.")]
Sbatch = Annotated[List[str], option("--sbatch", help="slurm: one more #SBATCH option (repeatable), e.g. "
                                  "--sbatch=--constraint=a100.")]
MaxConcurrent = Annotated[Optional[int], option("--max-concurrent", min=1, help="slurm: at most this many tasks at "
                                             "once (the array's %K).")]
SignalSeconds = Annotated[int, option("--signal-seconds", min=1, help="slurm: USR2 this long before the time limit: "
                                   "checkpoint and requeue.")]
DryRun = Annotated[bool, option("--dry-run", help="slurm: write the job script, do not submit it.")]


#: bench grid's options per launcher (parameter name -> flag).
SLURM_OPTIONS = {"partition": "--partition", "time_limit": "--time", "gpus": "--gpus", "cpus": "--cpus",
                 "mem": "--mem", "account": "--account", "qos": "--qos", "sbatch": "--sbatch",
                 "max_concurrent": "--max-concurrent", "signal_seconds": "--signal-seconds", "dry_run": "--dry-run"}
LOCAL_OPTIONS = {"jobs": "--jobs"}


def _list_grids(json_out: bool) -> None:
    """``--list``: the shipped grids with their run counts and shapes, as text or JSON."""
    from structinit.experiments.gridspec import load_grid, shipped_grids

    rows = [load_grid(name).summary() for name in shipped_grids()]
    if json_out:
        emit_json(rows)
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        shape = " x ".join(f"{len(v)} {k}" for k, v in r["axes"].items())
        typer.echo(f"{r['name']:<{width}}  {r['runs']:>4} runs ({shape} x {len(r['seeds'])} seeds)  {r['title']}")


def _refuse_idle_options(ctx: typer.Context, grid: Optional[str], list_grids: bool, status: bool,
                         launcher: str) -> None:
    """Options that would do nothing in the mode asked for are errors, not silently ignored."""
    from structinit.errors import UsageError

    if list_grids:
        if grid is not None:
            raise UsageError(f"--list lists the shipped grids and takes no grid (got {grid!r}); for that grid's runs: "
                             f"structinit bench grid {grid} --status")
        others = {n: f for n, f in {**SLURM_OPTIONS, **LOCAL_OPTIONS, "status": "--status", "overrides": "--set",
                                    "seeds": "--seeds", "only": "--only", "out": "--out", "data_dir": "--data-dir",
                                    "launcher": "--launcher", "threads": "--threads", "yes": "--yes"}.items()}
        extra = given_flags(ctx, others)
        if extra:
            raise UsageError(f"--list takes no other option than --json; {extra[0]} would do nothing")
        return
    if status:
        extra = given_flags(ctx, {"launcher": "--launcher", **LOCAL_OPTIONS, **SLURM_OPTIONS})
        if extra:
            raise UsageError(f"--status launches nothing, so {extra[0]} would do nothing; drop it (or --status)")
        return
    if launcher != "slurm":
        extra = given_flags(ctx, SLURM_OPTIONS)
        if extra:
            raise UsageError(f"{extra[0]} is an option of --launcher slurm, not of --launcher {launcher}; it would do "
                             "nothing here")
    if launcher != "local":
        extra = given_flags(ctx, LOCAL_OPTIONS)
        if extra:
            raise UsageError(f"{extra[0]} is an option of --launcher local, not of --launcher {launcher}; it would do "
                             "nothing here")


def bench_grid(
    ctx: typer.Context,
    grid: GridArg = None,
    list_grids: ListGrids = False,
    status: Status = False,
    overrides: Sets = [],  # noqa: B006
    seeds: Seeds = None,
    only: Only = [],  # noqa: B006
    out: RunsDir = Path("runs"),
    data_dir: DataDir = None,
    launcher: Launcher = "local",
    jobs: Jobs = 1,
    threads: Threads = None,
    partition: Partition = None,
    time_limit: TimeLimit = None,
    gpus: Gpus = 0,
    cpus: Cpus = None,
    mem: Mem = None,
    account: Account = None,
    qos: Qos = None,
    sbatch: Sbatch = [],  # noqa: B006
    max_concurrent: MaxConcurrent = None,
    signal_seconds: SignalSeconds = 120,
    dry_run: DryRun = False,
    yes: Yes = False,
    json_out: JsonOut = False,
):
    """Run the comparison of a grid: every cell and seed a training run, in a folder named by its run key.

    Finished runs are skipped and interrupted ones resume from their checkpoint, so the same
    command continues a grid; impulse artifacts are solved into the cache once, before anything
    starts (the setup, with progress and the time left). Ctrl-C or SIGTERM, in any phase, exits
    130 with one line. Then `structinit bench report` turns what has finished into the paper's tables.
    """
    import signal
    import time

    from structinit.errors import UsageError
    from structinit.experiments.launch import check_launcher, sigterm_interrupts

    t0 = time.perf_counter()
    check_launcher(launcher)
    _refuse_idle_options(ctx, grid, list_grids, status, launcher)
    if list_grids:
        _list_grids(json_out)
        return
    if grid is None:
        raise UsageError("give a grid: a shipped name (structinit bench grid --list) or a .toml file")
    options = None
    if launcher == "slurm":  # bad cluster options are refused before anything else is said or done
        options = _slurm_options(partition, time_limit, gpus, cpus, mem, account, qos, sbatch, max_concurrent,
                                 signal_seconds, dry_run)
    command = grid_command(grid, out, overrides, seeds, data_dir, only)
    old_term = sigterm_interrupts()  # from here on SIGTERM stops the command as Ctrl-C does, named
    try:
        setup = _setup(grid, overrides, seeds, out, data_dir, command, only, yes, json_out, status, launcher, threads)
        if setup is None:  # --status said where the runs stand
            return
        ex, todo, result = setup
        if not todo:
            _say_nothing_to_launch(ex, result, time.perf_counter() - t0, json_out)
        elif launcher == "print":
            _print_commands(ex, todo, result, json_out)
        elif launcher == "slurm":
            _submit_job_array(ex, todo, options, command, dry_run, result, json_out)
        else:
            _launch_local(ex, todo, jobs, threads, command, result, json_out)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _setup(grid: str, overrides, seeds, out: Path, data_dir, command: str, only, yes: bool, json_out: bool,
           status: bool, launcher: str, threads: Optional[int]):
    """Everything before the runs start: the grid expanded, ``--status`` (then ``None``), the runs
    to launch prepared and their init artifacts solved (``(ex, todo, result)``). Ctrl-C or SIGTERM
    meanwhile ends the command with one line naming the signal and the phase, exit code 130 (what
    was solved is in the cache and the same command goes on from there). SIGTERM must raise
    :class:`~structinit.experiments.launch.Interrupted` (the caller's ``sigterm_interrupts``)."""
    from structinit.cli.common import fail
    from structinit.experiments.launch import interruption_name, presolve

    phase, after = "expanding the grid", "the same command continues the grid"
    try:
        ex = _expand_grid(grid, overrides, seeds, out, data_dir, command, only, yes, json_out)
        if status:
            phase, after = "reading the runs' status", "nothing was changed"
            _print_status(ex, json_out)
            return None
        phase = "preparing the runs"
        todo = _runs_to_launch(ex, launcher)
        result: Dict[str, Any] = {"grid": ex.spec.name, "runs_dir": str(out), "total": len(ex.unique_cells()),
                                  "to_launch": len(todo), "launcher": launcher, "manifest": str(ex.manifest_path)}
        if todo:
            phase = "solving the init artifacts before the runs (the setup)"
            after = ("before any run started; what was solved is kept in the cache, and the same command "
                     "continues the grid")
            with Progress("setup", enabled=not json_out) as bar:
                bar.log(f"grid {ex.spec.name}: {len(todo)} of {len(ex.unique_cells())} runs to launch into {out}")
                result["presolve"] = presolve(todo, log=bar.log, threads=threads, progress=bar.update,
                                              stage=lambda words: bar.stage(f"setup: {words}"))
        return ex, todo, result
    except KeyboardInterrupt as exc:
        raise fail(f"interrupted ({interruption_name(exc)}) while {phase}, {after}", 130) from None


def _slurm_options(partition, time_limit, gpus, cpus, mem, account, qos, sbatch, max_concurrent, signal_seconds,
                   dry_run):
    """The checked :class:`~structinit.experiments.slurm.SlurmOptions` of the slurm flags; unless
    ``dry_run``, ``sbatch`` must be there to submit with."""
    from structinit.experiments.slurm import SlurmOptions, check_sbatch

    options = SlurmOptions(partition=partition, time=time_limit, gpus=gpus, cpus=cpus, mem=mem, account=account,
                           qos=qos, extra=list(sbatch), max_concurrent=max_concurrent, signal_seconds=signal_seconds)
    options.validate()
    if not dry_run:
        check_sbatch()
    return options


def _expand_grid(grid: str, overrides, seeds, out: Path, data_dir, command: str, only, yes: bool, json_out: bool):
    """The grid expanded into its runs (progress on stderr; its warnings as ``warning:`` lines)."""
    from structinit.experiments.expand import MAX_RUNS, expand
    from structinit.experiments.gridspec import load_grid

    with Progress("expanding the grid", enabled=not json_out) as bar:
        ex = expand(load_grid(grid), overrides=overrides, seeds=seeds, runs_dir=out, data_root=data_dir,
                    command=command, only=only, max_runs=None if yes else MAX_RUNS, progress=bar.update)
    for warning in ex.warnings:
        typer.echo(f"warning: {warning}", err=True)
    return ex


def _print_status(ex, json_out: bool) -> None:
    """``--status``: finished / running / failed / pending, as text or JSON."""
    from structinit.experiments.status import grid_status, status_text

    st = grid_status(ex)
    emit_json(st.to_dict()) if json_out else typer.echo(status_text(st))


def _runs_to_launch(ex, launcher: str):
    """The cells whose runs are not finished, their folders prepared; what the launcher cannot
    provide (a dataset, a GPU) said as ``warning:`` lines naming this command's flags."""
    from structinit.cli.common import declared_flags, flag_for
    from structinit.errors import StructinitError
    from structinit.experiments.launch import check_environment, prepare_runs

    def warn(message: str) -> None:
        text = StructinitError(message).render(lambda n: flag_for(n, declared_flags(bench_grid), ALIASES))
        typer.echo("warning: " + text, err=True)

    return prepare_runs(ex, check=lambda cells: check_environment(cells, launcher, warn=warn))


def _say_nothing_to_launch(ex, result: Dict[str, Any], seconds: float, json_out: bool) -> None:
    """Every run is finished or running: say so (with the grid's counts) and where the report is."""
    from structinit.experiments.status import grid_status

    st = grid_status(ex)
    result.update(counts=st.counts, seconds=round(seconds, 3))
    if json_out:
        emit_json(result)
    else:
        running = f" ({st.counts['running']} still running)" if st.counts["running"] else ""
        typer.echo(f"grid {ex.spec.name}: nothing to launch: {st.counts['finished']} of {st.total} runs finished"
                   f"{running}. Report: structinit bench report {result['runs_dir']}")


def _print_commands(ex, todo, result: Dict[str, Any], json_out: bool) -> None:
    """``--launcher print``: one ``structinit train`` command per run, for any other scheduler."""
    from structinit.experiments.launch import print_commands

    cmds = print_commands(ex, todo)
    if json_out:
        emit_json(dict(result, commands=cmds))
    else:
        typer.echo("\n".join(c["command"] for c in cmds))


def _submit_job_array(ex, todo, options, command: str, dry_run: bool, result: Dict[str, Any], json_out: bool) -> None:
    """``--launcher slurm``: write the job array's script and submit it (not with ``--dry-run``)."""
    from structinit.experiments.slurm import submit, write_job

    job = write_job(ex, todo, options, command=command)
    result.update(script=str(job.script), tasks=str(job.tasks), logs=str(job.folder / "logs"))
    if dry_run:
        result["submitted"] = False
        emit_json(result) if json_out else typer.echo(
            f"wrote {job.script} ({job.count} array tasks); submit it with: sbatch {job.script}")
        return
    job_id = submit(job)
    result.update(submitted=True, job_id=job_id)
    emit_json(result) if json_out else typer.echo(
        f"submitted job {job_id}: {job.count} array tasks (script {job.script}, logs in {job.folder / 'logs'}). "
        f"Follow it with: {command} --status")


def _launch_local(ex, todo, jobs: int, threads: Optional[int], command: str, result: Dict[str, Any],
              json_out: bool) -> None:
    """``--launcher local``: train the runs on this machine, ``jobs`` at once; exit 130 when
    interrupted, 1 when a run failed."""
    from structinit.experiments.launch import run_local

    with Progress("runs", enabled=not json_out, transient=False) as bar:
        summary = run_local(ex, todo, jobs=jobs, threads=threads, progress=bar.update, log=bar.log)
    result.update(summary.to_dict())
    if json_out:
        emit_json(result)
    else:
        parts = ", ".join(f"{n} {k}" for k, n in sorted(summary.outcomes.items()))
        over = summary.overhead_seconds
        typer.echo(f"grid {ex.spec.name}: {summary.launched} run(s) launched: {parts or 'none finished'} in "
                   f"{summary.wall_seconds:.1f}s ({summary.train_seconds:.1f}s training"
                   + (f", {over:.2f}s per run outside training" if over is not None else "") + f"). Report: "
                   f"structinit bench report {result['runs_dir']}")
    if summary.interrupted:
        typer.echo(f"interrupted; the same command continues the grid (status: {command} --status)", err=True)
        raise typer.Exit(130)
    if summary.outcomes.get("failed", 0):
        raise typer.Exit(1)
