"""``structinit bench``: benchmarks; ``bench solver`` runs the solver recipes side by side on one shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import (
    Depth,
    Device,
    Dim,
    Filter,
    GridOpt,
    Heads,
    JsonOut,
    Progress,
    Seed,
    Threads,
    Tokens,
    emit_json,
    examples,
    path_arg,
)

SOLVER_EXAMPLES = examples(
    'structinit bench solver --tokens 64 --dim 64 --heads 4 --iters 300      # all four recipes, paper shortened',
    'structinit bench solver --tokens 64 --dim 64 --heads 4 --recipes fast,paper --iters 200 --json',
    'structinit bench solver --grid 14x14 --dim 768 --heads 12 --depth 12 --recipes fast',
)


ALL_RECIPES = "paper,released,closed-form,fast"


def _effective_match(match: Optional[str], names: List[str], target_mass: Optional[float],
                     iters: Optional[int]) -> Optional[str]:
    """The recipe fast matches (``None``: none), refusing options that would have no effect."""
    from structinit.errors import UsageError

    if match is None:
        match = "paper" if "paper" in names and "fast" in names else None
    elif match.strip().lower() == "none":
        match = None
    elif match not in names or "fast" not in names:
        raise UsageError(f"--match {match} compares fast with {match}; both must be in --recipes "
                         f"(got {','.join(names) or 'none'})")
    if target_mass is not None and "fast" not in names:
        raise UsageError("--target-mass is the fast recipe's, which is not in --recipes")
    if target_mass is not None and match is not None:
        raise UsageError(f"--target-mass has no effect while fast matches {match}'s mass; add --match none to set it")
    if iters is not None and not {"paper", "released"} & set(names):
        raise UsageError("--iters is for the paper and released recipes, and neither is in --recipes")
    return match


def bench_solver(
    tokens: Tokens = None,
    grid: GridOpt = None,
    dim: Dim = 192,
    heads: Heads = 3,
    filter_size: Filter = 3,
    layers: Depth = 1,
    recipes: Annotated[str, typer.Option("--recipes", help="Comma-separated recipes.")] = ALL_RECIPES,
    match: Annotated[Optional[str], typer.Option("--match", help="Ask fast for the target mass this recipe reached "
                                                 "('none': use --target-mass).",
                                                 show_default="paper, when paper and fast both run")] = None,
    target_mass: Annotated[Optional[float], typer.Option("--target-mass", help="fast's target mass when not "
                                                         "matching.", show_default="0.3")] = None,
    iters: Annotated[Optional[int], typer.Option("--iters", help="Iterations of paper/released.",
                                                 show_default="10000")] = None,
    seed: Seed = 0,
    device: Device = "auto",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Run solver recipes on one shape in one process: seconds, MSE, hit rate, target mass."""
    from structinit.benchmarks.solver import run_solver_bench, solver_bench_table
    from structinit.geometry.grid import parse_grid
    from structinit.runtime import use_threads

    use_threads(threads)
    if tokens is None and grid is None:
        tokens = 256
    names: List[str] = [r.strip() for r in recipes.split(",") if r.strip()]
    match = _effective_match(match, names, target_mass, iters)
    with Progress("bench solver", enabled=not json_out) as bar:
        result = run_solver_bench(parse_grid(tokens, grid), dim, heads, filter_size, layers, names, match=match,
                                  target_mass=target_mass, iters=iters, seed=seed, device=device, progress=bar,
                                  on_recipe=lambda name, i, n: bar.stage(f"recipe {i + 1}/{n}: {name}"))
    if json_out:
        emit_json(result)
    else:
        typer.echo(solver_bench_table(result))


FIT_EXAMPLES = examples(
    'structinit bench fit --model vit-digits --dataset digits --versions 1,2 --threads 1   # real digits',
    'structinit bench fit --model vit-t --image-size 32 --in-chans 3 --threads 1          # ViT-T shape, noise',
)


def bench_fit(
    model: Annotated[str, typer.Option("--model", help="A ViT preset (see structinit train --help).")] = "vit-digits",
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Real inputs: an in-memory image dataset "
                                                   "(digits, fashion-mnist, ...); without it, noise images.",
                                                   show_default="noise")] = None,
    image_size: Annotated[Optional[int], typer.Option("--image-size", min=1, help="Noise images: side.",
                                                      show_default="32")] = None,
    in_chans: Annotated[Optional[int], typer.Option("--in-chans", min=1, help="Noise images: channels.",
                                                    show_default="3")] = None,
    versions: Annotated[str, typer.Option("--versions", help="Data fit versions to time, comma-separated.")] = "2",
    samples: Annotated[int, typer.Option("--samples", min=1, help="Inputs the fit gets.")] = 256,
    steps: Annotated[int, typer.Option("--steps", min=1, help="The fit's Adam steps (fewer: to time a slow "
                                       "version's steps; the init then is not the default).")] = 300,
    train_steps: Annotated[int, typer.Option("--train-steps", min=1, help="Training steps (batch 64) timed as the "
                                             "unit.")] = 10,
    seed: Seed = 0,
    device: Device = "cpu",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Time the default impulse init with its data fit against training steps of the same model."""
    from structinit.benchmarks.fit import fit_bench_table, run_fit_bench
    from structinit.errors import UsageError
    from structinit.runtime import use_threads

    if dataset is not None and (image_size is not None or in_chans is not None):
        raise UsageError("--image-size and --in-chans shape the noise images; --dataset has its own")
    try:
        wanted = [int(v) for v in versions.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--versions takes comma-separated integers, got {versions!r}") from None
    use_threads(threads)
    with Progress("bench fit", enabled=not json_out) as bar:
        result = run_fit_bench(model, dataset=dataset, image_size=image_size or 32, in_chans=in_chans or 3,
                               versions=wanted, samples=samples, train_steps=train_steps, steps=steps, seed=seed,
                               device=device,
                               progress=bar.stage)
    if json_out:
        emit_json(result)
    else:
        typer.echo(fit_bench_table(result))


LOOP_EXAMPLES = examples(
    'structinit bench loop --model vit-digits --dataset digits --threads 1',
)


def bench_loop(
    model: Annotated[str, typer.Option("--model", help="A preset (see structinit train --help).")] = "vit-digits",
    dataset: Annotated[str, typer.Option("--dataset", help="An in-memory dataset.")] = "digits",
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Batch size.")] = 64,
    epochs: Annotated[int, typer.Option("--epochs", "-e", min=1, help="Epochs a repeat.")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Repeats of each loop, alternating.")] = 3,
    seed: Seed = 0,
    device: Device = "cpu",
    amp: Annotated[str, typer.Option("--amp", help="Mixed precision, as train's: auto (bf16/fp16 on a GPU, off on "
                                     "the CPU), bf16, fp16 or off.")] = "auto",
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="Where the dataset's files are.",
                                                     show_default="the dataset's default")] = None,
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Images per second of train's epoch loop against a bare PyTorch loop of the same recipe."""
    from structinit.benchmarks.loop import loop_bench_table, run_loop_bench
    from structinit.runtime import use_threads

    use_threads(threads)
    with Progress("bench loop", enabled=not json_out) as bar:
        result = run_loop_bench(model, dataset, batch_size=batch_size, epochs=epochs, repeats=repeats, seed=seed,
                                device=device, amp=amp, data_dir=data_dir, progress=bar.stage)
    if json_out:
        emit_json(result)
    else:
        typer.echo(loop_bench_table(result))


# --------------------------------------------------------------------------- bench grid / report / run

GRID_EXAMPLES = examples(
    'structinit bench grid --list                                   # the shipped grids and their run counts',
    'structinit bench grid digits --jobs 2                          # the digits learning curve on this machine',
    'structinit bench grid digits --set epochs=1 --seeds 1 --only train_size=100 --only init=mimetic,impulse '
    '--jobs 2   # a quick reduced run',
    'structinit bench grid digits --status                          # finished / running / failed / pending',
    'structinit bench grid table2 --data-dir ~/data --launcher slurm --partition gpu --gpus 1 --cpus 8 '
    '--time 12:00:00 --max-concurrent 16',
    'structinit bench grid my-grid.toml --launcher print > commands.txt',
)
REPORT_EXAMPLES = examples(
    'structinit bench report runs                                   # every grid launched into ./runs',
    'structinit bench report digits --set epochs=1 --seeds 1 --only train_size=100 --only init=mimetic,impulse   '
    '# the runs of that expansion',
    'structinit bench report runs --report-dir report --attention  # + CSV, figures, attention after init',
    'structinit bench report runs --json',
)
RUN_EXAMPLES = examples(
    'structinit bench run runs/3f2a9c1b7d4e                         # train (or resume) one run of a grid',
    'structinit bench run runs/3f2a9c1b7d4e --nproc 4               # under torchrun, 4 processes',
)

Opt = typer.Option
Sets = Annotated[List[str], Opt("--set", help="Change a training setting for every run: NAME=VALUE (repeatable), "
                                "e.g. epochs=1 or device=cuda; init_params.NAME=VALUE changes the runs whose init "
                                "method takes NAME.")]
Seeds = Annotated[Optional[str], Opt("--seeds", help="Seeds: a count N (seeds 0..N-1), a list such as 0,3,7, or a "
                                     "range such as 5-9 (one seed alone: 7,).",
                                     show_default="the grid's")]
Only = Annotated[List[str], Opt("--only", help="Keep only some values of an axis: AXIS=ID[,ID...] (repeatable), "
                                "e.g. train_size=100,250.")]
RunsDir = Annotated[Path, Opt("--out", "-o", help="Where the runs live: one folder per run, named by its key.",
                               parser=path_arg, metavar="DIR")]
Yes = Annotated[bool, Opt("--yes", help="Expand a grid of more than 10,000 runs (refused without it: expanding "
                                     "alone takes minutes to hours).")]
DataDir = Annotated[Optional[Path], Opt("--data-dir", help="Data root: every run reads its dataset from here; a "
                                        "grid's relative data_dir is read below it.",
                                        show_default="$STRUCTINIT_DATA, else ./data", parser=path_arg, metavar="DIR")]


def _grid_command(grid: str, out: Path, overrides: List[str], seeds: Optional[str],
                  data_dir: Optional[Path], only: List[str] = ()) -> str:
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


def _list_grids(json_out: bool) -> None:
    from structinit.experiments.gridspec import load_grid, shipped_grids

    rows = [load_grid(name).summary() for name in shipped_grids()]
    if json_out:
        emit_json(rows)
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        shape = " x ".join(f"{len(v)} {k}" for k, v in r["axes"].items())
        typer.echo(f"{r['name']:<{width}}  {r['runs']:>4} runs ({shape} x {len(r['seeds'])} seeds)  {r['title']}")


#: bench grid's options per launcher (parameter name -> flag).
SLURM_OPTIONS = {"partition": "--partition", "time_limit": "--time", "gpus": "--gpus", "cpus": "--cpus",
                 "mem": "--mem", "account": "--account", "qos": "--qos", "sbatch": "--sbatch",
                 "max_concurrent": "--max-concurrent", "signal_seconds": "--signal-seconds", "dry_run": "--dry-run"}
LOCAL_OPTIONS = {"jobs": "--jobs"}


def _given(ctx: typer.Context, names: Dict[str, str]) -> List[str]:
    """The flags among ``names`` (parameter -> flag) given on the command line."""
    out = []
    for name, flag in names.items():
        source = ctx.get_parameter_source(name)
        # compared by name: newer Typer releases vendor their own copy of click's ParameterSource
        if source is not None and getattr(source, "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP"):
            out.append(flag)
    return out


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
        extra = _given(ctx, others)
        if extra:
            raise UsageError(f"--list takes no other option than --json; {extra[0]} would do nothing")
        return
    if status:
        extra = _given(ctx, {"launcher": "--launcher", **LOCAL_OPTIONS, **SLURM_OPTIONS})
        if extra:
            raise UsageError(f"--status launches nothing, so {extra[0]} would do nothing; drop it (or --status)")
        return
    if launcher != "slurm":
        extra = _given(ctx, SLURM_OPTIONS)
        if extra:
            raise UsageError(f"{extra[0]} is an option of --launcher slurm, not of --launcher {launcher}; it would do "
                             "nothing here")
    if launcher != "local":
        extra = _given(ctx, LOCAL_OPTIONS)
        if extra:
            raise UsageError(f"{extra[0]} is an option of --launcher local, not of --launcher {launcher}; it would do "
                             "nothing here")


def bench_grid(
    ctx: typer.Context,
    grid: Annotated[Optional[str], typer.Argument(help="A shipped grid (see --list) or a grid file (.toml).",
                                                  show_default=False)] = None,
    list_grids: Annotated[bool, Opt("--list", help="List the shipped grids with their run counts.")] = False,
    status: Annotated[bool, Opt("--status", help="Say how many runs are finished, running, failed (with the last "
                                "line of their log) and pending; launch nothing.")] = False,
    overrides: Sets = [],  # noqa: B006
    seeds: Seeds = None,
    only: Only = [],  # noqa: B006
    out: RunsDir = Path("runs"),
    data_dir: DataDir = None,
    launcher: Annotated[str, Opt("--launcher", help="local (this machine), slurm (a job array) or print (the "
                                 "commands, for any other scheduler).")] = "local",
    jobs: Annotated[int, Opt("--jobs", min=1, help="local: runs at once (CPU threads are divided between "
                             "them).")] = 1,
    threads: Threads = None,
    partition: Annotated[Optional[str], Opt("--partition", help="slurm: partition.")] = None,
    time_limit: Annotated[Optional[str], Opt("--time", help="slurm: time limit per task (HH:MM:SS or "
                                             "D-HH:MM:SS).")] = None,
    gpus: Annotated[int, Opt("--gpus", min=0, help="slurm: GPUs per task (more than one: torchrun).")] = 0,
    cpus: Annotated[Optional[int], Opt("--cpus", min=1, help="slurm: CPUs per task.")] = None,
    mem: Annotated[Optional[str], Opt("--mem", help="slurm: memory per task, e.g. 32G.")] = None,
    account: Annotated[Optional[str], Opt("--account", help="slurm: account.")] = None,
    qos: Annotated[Optional[str], Opt("--qos", help="slurm: quality of service.")] = None,
    sbatch: Annotated[List[str], Opt("--sbatch", help="slurm: one more #SBATCH option (repeatable), e.g. "
                                     "--sbatch=--constraint=a100.")] = [],  # noqa: B006
    max_concurrent: Annotated[Optional[int], Opt("--max-concurrent", min=1, help="slurm: at most this many tasks "
                                                 "at once (the array's %K).")] = None,
    signal_seconds: Annotated[int, Opt("--signal-seconds", min=1, help="slurm: USR2 this long before the time "
                                       "limit: checkpoint and requeue.")] = 120,
    dry_run: Annotated[bool, Opt("--dry-run", help="slurm: write the job script, do not submit it.")] = False,
    yes: Yes = False,
    json_out: JsonOut = False,
):
    """Run the comparison of a grid: every cell and seed a training run, in a folder named by its run key.

    Finished runs are skipped and interrupted ones resume from their checkpoint, so the same
    command continues a grid; impulse artifacts are solved into the cache once, before anything
    starts. Then `structinit bench report` turns what has finished into the paper's tables.
    """
    import time

    from structinit.cli.common import declared_flags, flag_for
    from structinit.errors import StructinitError, UsageError
    from structinit.experiments.expand import MAX_RUNS, expand
    from structinit.experiments.gridspec import load_grid
    from structinit.experiments.launch import (
        check_environment,
        check_launcher,
        prepare,
        presolve,
        print_commands,
        run_local,
    )
    from structinit.experiments.status import grid_status, status_text

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
        from structinit.experiments.slurm import SlurmOptions, check_sbatch

        options = SlurmOptions(partition=partition, time=time_limit, gpus=gpus, cpus=cpus, mem=mem, account=account,
                               qos=qos, extra=list(sbatch), max_concurrent=max_concurrent,
                               signal_seconds=signal_seconds)
        options.validate()
        if not dry_run:
            check_sbatch()
    command = _grid_command(grid, out, overrides, seeds, data_dir, only)
    with Progress("expanding the grid", enabled=not json_out) as bar:
        ex = expand(load_grid(grid), overrides=overrides, seeds=seeds, runs_dir=out, data_root=data_dir,
                    command=command, only=only, max_runs=None if yes else MAX_RUNS, progress=bar.update)
    for warning in ex.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if status:
        st = grid_status(ex)
        emit_json(st.to_dict()) if json_out else typer.echo(status_text(st))
        return
    todo = prepare(ex, check=lambda cells: check_environment(
        cells, launcher, warn=lambda m: typer.echo("warning: " + StructinitError(m).render(
            lambda n: flag_for(n, declared_flags(bench_grid), ALIASES)), err=True)))
    report_cmd = f"structinit bench report {out}"
    result: Dict[str, Any] = {"grid": ex.spec.name, "runs_dir": str(out), "total": len(ex.unique_cells()),
                              "to_launch": len(todo), "launcher": launcher, "manifest": str(ex.manifest_path)}
    if not todo:
        st = grid_status(ex)
        result.update(counts=st.counts, seconds=round(time.perf_counter() - t0, 3))
        if json_out:
            emit_json(result)
        else:
            running = f" ({st.counts['running']} still running)" if st.counts["running"] else ""
            typer.echo(f"grid {ex.spec.name}: nothing to launch: {st.counts['finished']} of {st.total} runs finished"
                       f"{running}. Report: {report_cmd}")
        return
    with Progress("grid", enabled=not json_out) as bar:
        bar.log(f"grid {ex.spec.name}: {len(todo)} of {len(ex.unique_cells())} runs to launch into {out}")
        result["presolve"] = presolve(todo, log=bar.log, threads=threads)
    if launcher == "print":
        cmds = print_commands(ex, todo)
        if json_out:
            emit_json(dict(result, commands=cmds))
        else:
            typer.echo("\n".join(c["command"] for c in cmds))
        return
    if launcher == "slurm":
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
        return
    with Progress("runs", enabled=not json_out, transient=False) as bar:
        summary = run_local(ex, todo, jobs=jobs, threads=threads, progress=bar.update, log=bar.log)
    result.update(summary.to_dict())
    failed = summary.outcomes.get("failed", 0)
    if json_out:
        emit_json(result)
    else:
        parts = ", ".join(f"{n} {k}" for k, n in sorted(summary.outcomes.items()))
        over = summary.overhead_seconds
        typer.echo(f"grid {ex.spec.name}: {summary.launched} run(s) launched: {parts or 'none finished'} in "
                   f"{summary.wall_seconds:.1f}s ({summary.train_seconds:.1f}s training"
                   + (f", {over:.2f}s per run outside training" if over is not None else "") + f"). Report: "
                   f"{report_cmd}")
    if summary.interrupted:
        typer.echo(f"interrupted; the same command continues the grid (status: {command} --status)", err=True)
        raise typer.Exit(130)
    if failed:
        raise typer.Exit(1)


def bench_report(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="A folder of runs (bench grid's --out), or a grid (name or file) "
                                          "whose runs are in --out.", show_default=False)],
    out: RunsDir = Path("runs"),
    overrides: Sets = [],  # noqa: B006
    seeds: Seeds = None,
    only: Only = [],  # noqa: B006
    grid_name: Annotated[Optional[str], Opt("--grid", help="With a folder: report only this grid.")] = None,
    report_dir: Annotated[Optional[Path], Opt("--report-dir", help="Write report.md, cells.csv, runs.csv, "
                                              "report.json and the figures (PNG) into this folder.",
                                              parser=path_arg, metavar="DIR")] = None,
    force: Annotated[bool, Opt("--force", help="Replace an earlier report in --report-dir whole: its files "
                               "that this one does not write (e.g. figures) are removed and named on "
                               "stderr.")] = False,
    figures: Annotated[bool, Opt("--figures/--no-figures", help="Draw the figures (with --report-dir).")] = True,
    attention: Annotated[bool, Opt("--attention", help="Also draw the attention after init averaged over real "
                                   "training images, first / middle / last layer, one column per method (with "
                                   "--report-dir).")] = False,
    attention_column: Annotated[Optional[str], Opt("--attention-column", help="The grid column whose models are "
                                                   "drawn, as value ids joined by '/'.",
                                                   show_default="the first")] = None,
    attention_images: Annotated[int, Opt("--attention-images", min=1, help="Training images to average "
                                         "over.")] = 64,
    runs_csv: Annotated[List[Path], Opt("--runs-csv", help="The runs.csv of an earlier report (repeatable): a run "
                                        "whose folder is not in --out (or not finished there) is taken from it by "
                                        "its run key, without its per-epoch curve. With a grid.")] = [],  # noqa: B006
    baseline: Annotated[Optional[str], Opt("--baseline", help="The row (init id) the differences are paired "
                                           "against. With a grid.", show_default="the grid's")] = None,
    mixed_versions: Annotated[bool, Opt("--mixed-versions", help="Pool the runs of a row even where they recorded "
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
    from structinit.experiments.expand import MAX_RUNS, expand
    from structinit.experiments.gridspec import load_grid
    from structinit.experiments.output import render_report, stale_report_files, write_report
    from structinit.experiments.report import collect, markdown, read_runs_csv, reports_for_folder

    if report_dir is None:
        extra = _given(ctx, {"force": "--force", "figures": "--figures/--no-figures", "attention": "--attention",
                             "attention_column": "--attention-column", "attention_images": "--attention-images"})
        if extra:
            raise UsageError(f"{extra[0]} is about the files --report-dir writes; without --report-dir it would do "
                             "nothing")
    if not attention:
        extra = _given(ctx, {"attention_column": "--attention-column", "attention_images": "--attention-images"})
        if extra:
            raise UsageError(f"{extra[0]} chooses what --attention draws; without --attention it would do nothing")
    elif not figures:
        raise UsageError("--attention draws a figure, which --no-figures turns off; give one of them")
    earlier = {}
    if Path(target).expanduser().is_dir():
        if overrides or seeds is not None or only or runs_csv or baseline:
            raise UsageError("--set, --seeds, --only, --runs-csv and --baseline apply to a grid; with a folder the "
                             "grids recorded in it are reported")
        if yes:
            raise UsageError("--yes lets a grid of many runs be expanded; a folder's grids were expanded when they "
                             "were launched, so it would do nothing")
        if _given(ctx, {"out": "--out"}):
            raise UsageError(f"--out says where a grid's runs are; {target} is itself the folder of runs reported, "
                             "so --out would do nothing")
        reports = reports_for_folder(Path(target).expanduser(), grid_name, mixed_versions)
    else:
        if grid_name is not None:
            raise UsageError(f"--grid picks one grid of a folder of runs; {target} is a grid, so it would do nothing")
        spec = load_grid(target)
        if baseline is not None:
            rows = [v.id for v in spec.row_axis.values]
            if baseline not in rows:
                raise UsageError(f"--baseline {baseline!r} is not a row of {spec.name}; its rows are {', '.join(rows)}")
            import dataclasses

            spec = dataclasses.replace(spec, baseline=baseline)
        for path in runs_csv:
            earlier.update(read_runs_csv(path))
        with Progress("expanding the grid", enabled=not json_out) as bar:
            ex = expand(spec, overrides=overrides, seeds=seeds, runs_dir=out, only=only,
                        command=_grid_command(target, out, overrides, seeds, None, only),
                        max_runs=None if yes else MAX_RUNS, progress=bar.update)
        if not out.is_dir() and not earlier:
            raise UsageError(f"no runs: {out} does not exist (launch the grid with structinit bench grid {target} "
                             f"--out {out})")
        reports = [collect(ex, earlier, mixed_versions)]
    if not earlier and not any(r.ex.run_dir(c).is_dir() for r in reports for c in r.ex.cells):
        raise UsageError(f"no runs of {target} in {reports[0].ex.runs_dir} yet; launch them with structinit bench "
                         "grid")
    att = None
    if attention:
        from structinit.analysis.figures import save_png  # noqa: F401  (matplotlib is needed)
        from structinit.experiments.attention import attention_grid_figure, column_arg, grid_attention

        att = {}
        for rep in reports:
            entries = grid_attention(rep.ex, column=column_arg(attention_column), images=attention_images)
            att[rep.name] = (attention_grid_figure(entries, title=rep.spec.title), entries)
    if report_dir is not None:
        files = render_report(reports, figures=figures, attention=att)
        replaced = stale_report_files(files, report_dir) if force else []
        written = write_report(files, report_dir, force=force)
        if not json_out:
            typer.echo(f"wrote {len(written)} files into {report_dir}: {', '.join(p.name for p in written)}")
        if replaced:  # said on stderr, so that --json stays parseable
            hint = " (--attention draws the attention figure again)" if any(n.endswith("-attention.png")
                                                                              for n in replaced) else ""
            typer.echo(f"removed {len(replaced)} files of the earlier report that this one does not write: "
                       f"{', '.join(replaced)}{hint}", err=True)
    if json_out:
        emit_json({"grids": [r.to_dict() for r in reports]})
    elif report_dir is None:
        typer.echo("\n".join(markdown(r) for r in reports))


def bench_run(
    runs: Annotated[List[Path], typer.Argument(help="Run folders of a grid (RUNS/<key>, holding config.json).",
                                               show_default=False)],
    threads: Threads = None,
    device: Annotated[Optional[str], Opt("--device", help="auto, cpu, cuda or cuda:N.",
                                         show_default="the run's")] = None,
    nproc: Annotated[int, Opt("--nproc", min=1, help="Train under torchrun with this many processes (one per "
                              "GPU).")] = 1,
    signal_seconds: Annotated[Optional[int], Opt("--signal-seconds", min=1, help="Seconds between SIGUSR2 and the "
                                                 "kill: finish the epoch first when it fits.")] = None,
    json_out: JsonOut = False,
):
    """Train (or resume) runs of a grid, one after another: the task of the SLURM and local launchers.

    A finished run is skipped; a run trained by another task right now is left to it. SIGTERM
    stops at the next optimizer step (the last finished epoch's checkpoint is kept); SIGUSR2 does the same
    and then asks SLURM to requeue the job.
    """
    import sys

    from structinit.experiments.task import Stopper, check_nproc, run_task
    from structinit.runtime import check_device, check_threads

    check_threads(threads)
    check_nproc(nproc)
    if device is not None:
        check_device(device)
    stopper = Stopper(grace=signal_seconds)
    stopper.install()
    outcomes = []
    try:
        for run in runs:
            if stopper.event.is_set():
                break
            outcome = run_task(run, threads=threads, device=device, nproc=nproc, stopper=stopper,
                               echo=lambda line: print(line, file=sys.stderr, flush=True), launcher="bench run")
            outcomes.append(outcome.to_dict())
            if not json_out:
                acc = f": final {outcome.final_acc:.2f}%" if outcome.final_acc is not None else ""
                err = f": {outcome.error}" if outcome.error else ""
                typer.echo(f"{outcome.state} {run}{acc}{err}")
    finally:
        stopper.restore()
    if json_out:
        emit_json(outcomes)
    if any(o["state"] == "failed" for o in outcomes):
        raise typer.Exit(1)


#: Library parameter names that the bench commands spell with another flag.
ALIASES = {"overrides": "--set", "only": "--only", "time": "--time", "seeds": "--seeds",
           "attention_column": "--attention-column", "yes": "--yes", "data_dir": "--data-dir",
           "download": "--set download=true"}
