"""Time and peak memory of ``structinit solve`` (the ``fast`` recipe) against the number of tokens N,
for the ViT-B width (dim 768, 12 heads, 12 layers): the table and the figure of docs/bench-solver.md.

Each point is a fresh process (``python -m structinit solve --grid SxS ... --force --json``) so its
peak resident memory is its own; wall time includes the interpreter and torch start-up, solver time
is the artifact's ``stats.seconds``.

    python docs/figures/solver_scaling.py measure --label now --out docs/figures/scaling-now.json
    PYTHONPATH=/path/to/older/checkout python docs/figures/solver_scaling.py measure --label before \\
        --sides 8,14,16,28 --out docs/figures/scaling-before.json
    python docs/figures/solver_scaling.py plot docs/figures/scaling-*.json --png docs/figures/solver-scaling.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = (8, 14, 16, 28, 32, 48, 64, 80, 100)


def measure(sides, dim: int, heads: int, depth: int, threads: int):
    """One row per grid side: tokens, wall seconds, solver seconds, peak RSS (MiB), quality."""
    rows = []
    base = _peak(["-c", "import torch, structinit.solver.run"])[1]
    for side in sides:
        with tempfile.TemporaryDirectory() as cache:
            args = ["-m", "structinit", "solve", "--grid", f"{side}x{side}", "--dim", str(dim), "--heads", str(heads),
                    "--depth", str(depth), "--force", "--json", "--threads", str(threads), "--device", "cpu",
                    "--cache-dir", cache]
            t0 = time.perf_counter()
            out, peak = _peak(args)
            wall = time.perf_counter() - t0
        doc = json.loads(out)
        row = {"side": side, "tokens": side * side, "wall_s": round(wall, 2),
               "solver_s": round(doc["stats"]["seconds"], 2), "peak_mib": round(peak), "interpreter_mib": round(base),
               **doc["stats"]["summary"]}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def _peak(args):
    """Run ``python ARGS``; return its stdout and its peak resident memory in MiB."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(args)}")
    return out, usage.ru_maxrss / 1024


def plot(files, png: Path) -> str:
    """The figure (two log-log panels) and a markdown table of every measured row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [json.loads(Path(f).read_text()) for f in files]
    fig = Figure(figsize=(10.5, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_m = fig.subplots(1, 2)
    colours = ("tab:blue", "tab:red", "tab:green", "tab:purple")
    for run, colour in zip(runs, colours):
        n = [r["tokens"] for r in run["rows"]]
        ax_t.plot(n, [r["solver_s"] for r in run["rows"]], "o-", color=colour, label=f"{run['label']}: the solve")
        ax_t.plot(n, [r["wall_s"] for r in run["rows"]], "s--", color=colour, alpha=0.5,
                  label=f"{run['label']}: the whole command")
        ax_m.plot(n, [r["peak_mib"] / 1024 for r in run["rows"]], "o-", color=colour, label=run["label"])
    base = runs[0]["rows"][0]["interpreter_mib"] / 1024
    ax_m.axhline(base, color="grey", linestyle=":", label="python + torch, nothing solved")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log")
        ax.set_xlabel("tokens N (an S x S grid)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds (log scale)")
    ax_t.set_title("time", fontsize=10)
    ax_m.set_ylim(0, None)
    ax_m.set_ylabel("peak resident memory of the process (GiB)")
    ax_m.set_title("peak memory", fontsize=10)
    meta = runs[0]
    load = ", ".join(f"{r['label']} {r['load_average'][0]:.1f}" for r in runs)
    fig.suptitle(f"structinit solve, fast recipe: dim {meta['dim']}, {meta['heads']} heads, {meta['depth']} layers, "
                 f"{meta['threads']} CPU thread\non a shared 2-core machine (1-minute load average at the start: "
                 f"{load})",
                 fontsize=10)
    fig.savefig(png, dpi=110)
    lines = ["| version | grid | N | solver s | whole command s | peak memory | hit rate | target mass |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["rows"]:
            lines.append(f"| {run['label']} | {r['side']}x{r['side']} | {r['tokens']} | {r['solver_s']:.2f} | "
                         f"{r['wall_s']:.1f} | {r['peak_mib'] / 1024:.2f} GiB | {r['hit_rate']:.3f} | "
                         f"{r['target_mass']:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--label", required=True)
    m.add_argument("--sides", default=",".join(map(str, SIDES)))
    m.add_argument("--dim", type=int, default=768)
    m.add_argument("--heads", type=int, default=12)
    m.add_argument("--depth", type=int, default=12)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("plot")
    g.add_argument("files", nargs="+")
    g.add_argument("--png", type=Path, required=True)
    a = p.parse_args()
    if a.cmd == "measure":
        rows = measure([int(s) for s in a.sides.split(",")], a.dim, a.heads, a.depth, a.threads)
        a.out.write_text(json.dumps({"label": a.label, "dim": a.dim, "heads": a.heads, "depth": a.depth,
                                     "threads": a.threads, "load_average": os.getloadavg(), "rows": rows},
                                    indent=1) + "\n")
    else:
        print(plot(a.files, a.png))


if __name__ == "__main__":
    main()
