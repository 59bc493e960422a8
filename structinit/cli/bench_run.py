"""``structinit bench run``: train (or resume) runs of a grid, one after another: the task the SLURM
and local launchers run (a thin layer over :func:`structinit.experiments.task.run_task`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import JsonOut, Threads, emit_json, examples, option

EXAMPLES = examples(
    'structinit bench run runs/3f2a9c1b7d4e                         # train (or resume) one run of a grid',
    'structinit bench run runs/3f2a9c1b7d4e --nproc 4               # under torchrun, 4 processes',
)


def bench_run(
    runs: Annotated[List[Path], typer.Argument(help="Run folders of a grid (RUNS/<key>, holding config.json).",
                                               show_default=False)],
    threads: Threads = None,
    device: Annotated[Optional[str], option("--device", help="auto, cpu, cuda or cuda:N.",
                                         show_default="the run's")] = None,
    nproc: Annotated[int, option("--nproc", min=1, help="Train under torchrun with this many processes (one per "
                              "GPU).")] = 1,
    signal_seconds: Annotated[Optional[int], option("--signal-seconds", min=1, help="Seconds between SIGUSR2 and the "
                                                 "kill: finish the epoch first when it fits.")] = None,
    json_out: JsonOut = False,
):
    """Train (or resume) runs of a grid, one after another: the task of the SLURM and local launchers.

    A finished run is skipped; a run trained by another task right now is left to it. SIGTERM
    stops at the next optimizer step (the last finished epoch's checkpoint is kept); SIGUSR2 does the same
    and then asks SLURM to requeue the job. A stopped run is reported `interrupted` and the exit
    code stays 0 (1 when a run failed); a run the stop came before is reported `interrupted` too,
    and nothing of it is written.
    """
    import sys

    from structinit.experiments.task import check_nproc, command_stopper, run_task
    from structinit.runtime import check_device, check_threads

    # first: a signal from here on is a stop request (the entry point installed it before loading
    # the command line; an in-process call installs it now)
    stopper = command_stopper(grace=signal_seconds)
    outcomes = []
    try:
        check_threads(threads)
        check_nproc(nproc)
        if device is not None:
            check_device(device)
        for run in runs:
            outcome = run_task(run, threads=threads, device=device, nproc=nproc, stopper=stopper,
                               echo=lambda line: print(line, file=sys.stderr, flush=True), launcher="bench run")
            outcomes.append(outcome.to_dict())
            if not json_out:
                acc = f": final {outcome.final_acc:.2f}%" if outcome.final_acc is not None else ""
                err = f": {outcome.error}" if outcome.error else ""
                typer.echo(f"{outcome.state} {run}{acc}{err}")
        if json_out:
            emit_json(outcomes)
    finally:
        # the process-wide stopper is retired (the process exits next: a signal now has nothing
        # left to stop and must not end it), an in-process call's restored
        stopper.release()
    if any(o["state"] == "failed" for o in outcomes):
        raise typer.Exit(1)
