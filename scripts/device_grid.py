"""Train the Fashion-MNIST grids (``fashion``, 49 tokens; ``fashion-196``, 196 tokens) on one GPU
within a fixed time, most important runs first, and pack what finished for ``bench report``.

The runs are tiny (a 4-layer, 64-wide ViT), so one run leaves a GPU mostly idle: ``--jobs`` worker
processes (one CPU thread each) share the card. All runs go through the library's own launcher
(``structinit.experiments.launch.run_local``), in one pool, in this order:

1. fashion-196: mimetic and the default impulse init, seeds 0-4 (the floors of the issue);
2. fashion-196: the other rows (trunc normal, Kaiming, the authors' two recipes, ConvMixer), seeds 0-2;
3. fashion (49 tokens): mimetic and impulse, seeds 0-9 (the 10 paired seeds);
4. fashion-196: the other rows, seeds 3-4; fashion: the other rows, seeds 0-2;
5. fashion-196: mimetic and impulse, seeds 5-9.

``--grids converged`` (or ``GRIDS=converged``) trains the converged-budget grid instead
(docs/results/fashion/gpu/converged/grid.toml: 30 epochs on all 55,000 images, about 20 minutes a
run on a shared H100, so one call finishes none): the default impulse init and mimetic, seed by
seed, then impulse-2024. Interrupted runs keep their checkpoints under ``--runs`` and resume from
them on the next call there; ``--keep-checkpoints`` (``KEEP_CHECKPOINTS=1``) also packs those
checkpoints into grid.tar.gz, so that another machine can resume them. ``--plan`` lists the runs
in launch order and trains nothing.

Within a tier, seed by seed, the longest runs (all 55,000 images) first. At ``--seconds`` the
launcher is stopped as Ctrl-C stops it (runs save a checkpoint and are marked interrupted; a rerun
with the same ``--runs`` resumes them). Then each grid is reported there (a finished run is trusted
only beside its checkpoint, which stays on that machine), and the run folders without their weights
and the reports go into ``OUT/grid.tar.gz``. Report them anywhere from the reports' ``runs.csv``:

    tar xzf grid.tar.gz -C gpu
    structinit bench report fashion-196 --out gpu --runs-csv gpu/reports/fashion-196/runs.csv \\
        --set device=cuda --seeds 5 --report-dir ...

Usage (from the repository root; python3 must have torch, timm, typer, rich, safetensors, filelock):

    PYTHONPATH=. python3 scripts/device_grid.py --out OUT --data-dir FASHION --seconds 470
    PYTHONPATH=. python3 scripts/device_grid.py ... --done docs/results/fashion/gpu/fashion-196/runs.csv \\
        --done docs/results/fashion/gpu/fashion/runs.csv      # go on where an earlier machine stopped
    PYTHONPATH=. python3 scripts/device_grid.py --device cpu --quick --seconds 120   # smoke test
    PYTHONPATH=. python3 scripts/device_grid.py --grids converged --keep-checkpoints --out OUT --seconds 470
    PYTHONPATH=. python3 scripts/device_grid.py --grids converged --plan             # the runs, in order
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

OTHERS = "trunc-normal,kaiming,impulse-2024,impulse-2025,convmixer"
#: The converged-budget grid (30 epochs on all 55,000 images; docs/results/fashion/gpu/converged/grid.toml).
CONVERGED = str(Path(__file__).resolve().parents[1] / "docs/results/fashion/gpu/converged/grid.toml")
PLANS = {  # --grids NAME: (grid, rows, seeds), in priority order
    "fashion": [
        ("fashion-196", "mimetic,impulse", [0, 1, 2, 3, 4]),
        ("fashion-196", OTHERS, [0, 1, 2]),
        ("fashion", "mimetic,impulse", list(range(10))),
        ("fashion-196", OTHERS, [3, 4]),
        ("fashion", OTHERS, [0, 1, 2]),
        ("fashion-196", "mimetic,impulse", [5, 6, 7, 8, 9]),
    ],
    # the default and mimetic first, seed by seed, then the authors' 2024 recipe
    "converged": [(CONVERGED, "impulse,mimetic", [0, 1, 2]), (CONVERGED, "impulse-2024", [0, 1, 2])],
}
SIZE_ORDER = {"all": 0, "5000": 1, "2000": 2, "1000": 3, "500": 4}  # longest first


class Pool:
    """The few things ``run_local`` asks of an expansion, for cells of several grids in one folder."""

    def __init__(self, runs: Path):
        self.runs_dir = runs
        self.owner = {}

    def run_dir(self, cell):
        return self.runs_dir / cell.key

    def describe(self, cell) -> str:
        ex = self.owner[cell.key]
        return f"{ex.spec.name}: {ex.describe(cell)}"


def main() -> None:
    """Parse the options and train; bad input is one ``error:`` line and exit status 2."""
    from structinit.errors import StructinitError

    try:
        train(parse_args())
    except (StructinitError, OSError) as exc:
        what = exc.render() if isinstance(exc, StructinitError) else f"{exc.filename}: {exc.strerror}"
        print(f"error: {what.splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "device-grid"), help="where grid.tar.gz and grid.log go")
    ap.add_argument("--runs", default="/tmp/structinit-device-runs", help="the run folders (kept between calls)")
    ap.add_argument("--data-dir", default=None, help="the Fashion-MNIST IDX files")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--seconds", type=float, default=470.0, help="stop the runs this long after the start")
    ap.add_argument("--quick", action="store_true", help="1 epoch, 500 images, 2 seeds (a smoke test)")
    ap.add_argument("--done", action="append", default=[], metavar="RUNS_CSV",
                    help="a runs.csv of an earlier call (repeatable): its finished runs are not trained again")
    ap.add_argument("--grids", default=os.environ.get("GRIDS") or "fashion",
                    help=f"comma-separated, of {', '.join(PLANS)} (default: $GRIDS, else fashion)")
    ap.add_argument("--keep-checkpoints", action="store_true", default=os.environ.get("KEEP_CHECKPOINTS") == "1",
                    help="pack the runs' checkpoints too (default: $KEEP_CHECKPOINTS=1), so that another machine "
                         "resumes the interrupted ones")
    ap.add_argument("--plan", action="store_true", help="list the runs in launch order and train nothing")
    args = ap.parse_args()
    if args.jobs < 1 or args.seconds <= 0:
        ap.error("--jobs must be at least 1 and --seconds above 0")
    names = [g.strip() for g in args.grids.split(",") if g.strip()]
    unknown = [g for g in names if g not in PLANS]
    if unknown or not names:
        ap.error(f"--grids takes {', '.join(PLANS)} (comma-separated), got {args.grids!r}")
    args.plan_tiers = [t for g in names for t in PLANS[g]]
    return args


def tier(grid: str, rows: str, seeds: list, args: argparse.Namespace, runs: Path, n: int):
    """One tier of the plan expanded, and the ``--set`` overrides it was expanded with (the report
    needs the same). ``--quick``: one epoch on 500 images (the grid's 500 column where it has one,
    else every run's training set cut to 500)."""
    from structinit.experiments.expand import expand
    from structinit.experiments.gridspec import load_grid

    spec = load_grid(grid)
    overrides, only = [f"device={args.device}"], [f"init={rows}"]
    if args.quick:
        overrides.append("epochs=1")
        sizes = {v.id for a in spec.column_axes if a.name == "train_size" for v in a.values}
        if "500" in sizes:
            only.append("train_size=500")
        else:
            overrides.append("train_size=500")
    ex = expand(spec, overrides=overrides, seeds=seeds, runs_dir=runs, data_root=args.data_dir, only=only,
                command=f"scripts/device_grid.py tier {n}")
    return ex, overrides


def train(args: argparse.Namespace) -> None:
    from structinit.experiments.launch import check_environment, prepare_runs, presolve, run_local

    t0 = time.monotonic()
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "grid.log", "a", buffering=1)

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")

    done = set()
    for path in args.done:
        with open(path, newline="") as f:
            done |= {r["key"] for r in csv.DictReader(f) if r.get("state") == "finished" and r.get("final_acc")}
    plan = [(g, r, s[:2]) for g, r, s in args.plan_tiers[:3]] if args.quick else args.plan_tiers
    pool, ordered, reports = Pool(runs), [], {}
    for n, (grid, rows, seeds) in enumerate(plan):
        ex, overrides = tier(grid, rows, seeds, args, runs, n)
        reports[grid] = (ex.spec.name, overrides)
        cells = ex.unique_cells() if args.plan else \
            prepare_runs(ex, check=lambda cells: check_environment(cells, "local", warn=log))
        todo = [c for c in cells if c.key not in done]
        for c in todo:
            pool.owner[c.key] = ex
            ordered.append((n, c.seed, SIZE_ORDER.get(c.column[0], 9), c))
        log(f"tier {n}: {ex.spec.name} {rows} seeds {seeds}: {len(todo)} runs to launch")
    ordered.sort(key=lambda t: t[:3])
    cells = [t[3] for t in ordered]
    if args.plan:
        for i, c in enumerate(cells):
            log(f"{i + 1:4d}. {pool.describe(c)} ({c.key})")
        return
    log(f"presolve: {presolve(cells, log=log, device=args.device)}")

    left = args.seconds - (time.monotonic() - t0)
    timer = threading.Timer(max(left, 1.0), lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
    log(f"launching {len(cells)} runs in {args.jobs} workers; stopping at {args.seconds:.0f} s")
    summary = run_local(pool, cells, jobs=args.jobs, threads=1, device=args.device, log=log, stop_timeout=40.0)
    timer.cancel()
    log(f"done: {json.dumps({k: v for k, v in summary.to_dict().items() if k != 'runs'})}")
    report_and_pack(args, runs, out, reports, logf, log)


def report_and_pack(args: argparse.Namespace, runs: Path, out: Path, reports: dict, logf, log) -> None:
    """Report each grid here (a finished run is trusted only beside its checkpoint, which stays here:
    the report's runs.csv carries the results; report anywhere with --runs-csv), then pack the run
    folders (their weights only with ``--keep-checkpoints``) and the reports into OUT/grid.tar.gz."""
    for grid, (name, overrides) in reports.items():
        cmd = [sys.executable, "-m", "structinit", "bench", "report", grid, "--out", str(runs), "--seeds", "10",
               "--report-dir", str(runs / "reports" / name), "--force", "--no-figures"] + \
              [a for o in overrides for a in ("--set", o)] + [a for p in args.done for a in ("--runs-csv", p)]
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=logf).returncode
        log(f"report {name}: exit {rc}")
    keep = args.keep_checkpoints
    with tarfile.open(out / "grid.tar.gz", "w:gz") as tar:
        for path in sorted(runs.iterdir()):
            tar.add(path, arcname=path.name, filter=lambda ti: None if ti.name.endswith(".pt") and not keep else ti)
    log(f"packed {out / 'grid.tar.gz'} ({(out / 'grid.tar.gz').stat().st_size / 1e6:.1f} MB"
        f"{', checkpoints included' if keep else ''})")


if __name__ == "__main__":
    main()
