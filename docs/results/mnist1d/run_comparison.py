"""The MNIST-1D comparison: every init of the 1-D transformer, and the 1-D CNN, on plain and
shuffled MNIST-1D, over several seeds, each run through the product's own ``structinit train``.

Runs one training process at a time (one torch thread), skips runs that already finished (their
``final.json``), resumes a run that was killed, then writes the report beside this script:
``README.md`` (tables), ``results.json`` (every run's numbers) and ``accuracy.png``.

    python docs/results/mnist1d/run_comparison.py                 # everything (hours on a laptop CPU)
    python docs/results/mnist1d/run_comparison.py --report-only   # tables and figure from finished runs
    python docs/results/mnist1d/run_comparison.py --seeds 0 --variants impulse-5,trunc-normal --data plain

Settings were chosen on the validation split (500 of the 4000 training sequences, ``--val-size``);
the test split is only read for the headline, the final epoch's accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

#: Every run: the 1-D transformer (or CNN) on MNIST-1D with these settings, chosen on validation.
COMMON = ["--dataset", "mnist1d", "--val-size", "500", "--epochs", "20", "--threads", "1"]
#: name -> extra arguments of ``structinit train``.
VARIANTS = {
    "trunc-normal": ["--model", "transformer-1d", "--init", "trunc-normal"],
    "impulse-5": ["--model", "transformer-1d", "--init", "impulse", "-p", "filter=5", "-p", "mimetic_vproj=true"],
    "mimetic": ["--model", "transformer-1d", "--init", "mimetic"],
    "cnn-1d": ["--model", "cnn-1d"],
    "kaiming": ["--model", "transformer-1d", "--init", "kaiming"],
    "impulse-3": ["--model", "transformer-1d", "--init", "impulse", "-p", "filter=3", "-p", "mimetic_vproj=true"],
    "impulse-9": ["--model", "transformer-1d", "--init", "impulse", "-p", "filter=9", "-p", "mimetic_vproj=true"],
    "impulse-5 Q/K only": ["--model", "transformer-1d", "--init", "impulse", "-p", "filter=5"],
}
#: Variants run on plain sequences only (ablations).
PLAIN_ONLY = ("impulse-5 Q/K only",)
DATA = {"plain": [], "shuffled": ["--shuffle-seq"]}
SEEDS = (0, 1, 2, 3, 4)
REFERENCE = "trunc-normal"
#: MNIST-1D's published test accuracies (Greydanus, "Scaling down deep learning"), for the figure.
PUBLISHED = {"MLP": 68.0, "GRU": 91.0, "CNN": 94.0, "CNN, shuffled": 56.0}


def run_dir(root: Path, variant: str, data: str, seed: int) -> Path:
    return root / f"{variant.replace(' ', '-').replace('/', '')}-{data}-s{seed}"


def command(variant: str, data: str, seed: int, out: Path):
    return [sys.executable, "-m", "structinit", "train", *VARIANTS[variant], *COMMON, *DATA[data],
            "--seed", str(seed), "--out", str(out), "--resume", "--json"]


def run_one(variant: str, data: str, seed: int, root: Path, log) -> dict:
    out = run_dir(root, variant, data, seed)
    final = out / "final.json"
    timing = out / "timing.json"
    if not (final.exists() and timing.exists()):
        cmd = command(variant, data, seed, out)
        log(f"$ {' '.join(cmd[1:])}")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"{variant} {data} seed {seed} failed:\n{done.stderr[-2000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        timing.write_text(json.dumps({"wall_seconds": wall, "cpu_seconds": cpu, "load": os.getloadavg()}))
    summary = json.loads(final.read_text())
    config = json.loads((out / "config.json").read_text())
    real = (config.get("init_report") or {}).get("data_attention") or {}
    t = json.loads(timing.read_text())
    return {"variant": variant, "data": data, "seed": seed, "test": summary["final_acc"],
            "val": summary["final_val_acc"], "best_epoch": summary["best_epoch"], "epochs": summary["epochs"],
            "params": summary["params"].get("trainable"), "wall_seconds": t["wall_seconds"],
            "cpu_seconds": t["cpu_seconds"], "load": t["load"][0], "init_hit_rate_real": real.get("hit_rate"),
            "init_target_mass_real": real.get("target_mass"),
            "init_hit_rate_pseudo": (config.get("init_report") or {}).get("hit_rate"),
            "command": "structinit train " + " ".join(command(variant, data, seed, Path("RUN"))[4:])}


# --------------------------------------------------------------------------- report

def mean_std(values):
    import numpy as np

    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def paired(rows, a: str, b: str, data: str):
    """Mean, std and standard error of ``a - b`` over the seeds both have."""
    import numpy as np

    x = {r["seed"]: r["test"] for r in rows if r["variant"] == a and r["data"] == data}
    y = {r["seed"]: r["test"] for r in rows if r["variant"] == b and r["data"] == data}
    seeds = sorted(set(x) & set(y))
    if not seeds:
        return None
    d = np.array([x[s] - y[s] for s in seeds])
    sd = float(d.std(ddof=1)) if len(d) > 1 else 0.0
    return {"mean": float(d.mean()), "std": sd, "se": sd / len(d) ** 0.5, "n": len(d), "seeds": seeds}


def figure(rows, path: Path, variants, data_kinds):
    import numpy as np
    from matplotlib.figure import Figure

    sys.path.insert(0, str(REPO))
    from structinit.analysis.figures import save_png

    fig = Figure(figsize=(6.0 * len(data_kinds), 5.0), layout="constrained")
    axes = fig.subplots(1, len(data_kinds), squeeze=False, sharey=True)[0]
    fig.suptitle("MNIST-1D: final-epoch test accuracy of the 1-D transformer by init, and the 1-D CNN\n"
                 "(dots: seeds; bar: mean ± std; dashed: published anchors)", fontsize=11)
    colours = {"plain": "tab:blue", "shuffled": "tab:orange"}
    for ax, data in zip(axes, data_kinds):
        for i, v in enumerate(variants):
            acc = [r["test"] for r in rows if r["variant"] == v and r["data"] == data]
            if not acc:
                continue
            m, s = mean_std(acc)
            ax.bar(i, m, color=colours.get(data, "grey"), alpha=0.35, yerr=s, capsize=4)
            ax.plot(np.full(len(acc), i) + np.linspace(-0.15, 0.15, len(acc)), acc, "o", color="black",
                    markersize=3)
            ax.text(i, m + max(s, 0.5) + 0.8, f"{m:.1f}", ha="center", fontsize=8)
        anchors = {k: v for k, v in PUBLISHED.items() if ("shuffled" in k) == (data == "shuffled")}
        for name, acc in anchors.items():
            ax.axhline(acc, color="grey", linestyle="--", linewidth=0.8)
            ax.text(len(variants) - 0.5, acc + 0.4, f"published {name} {acc:.0f}%", ha="right", fontsize=7,
                    color="dimgrey")
        ax.set_xticks(range(len(variants)), [v.replace(" ", "\n") for v in variants], fontsize=8)
        ax.set_title(f"{data} sequences" + (" (positions permuted)" if data == "shuffled" else ""), fontsize=10)
        ax.set_xlabel("init of the transformer (or the CNN)")
        ax.set_ylabel("test accuracy after the last epoch (%)")
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    path.unlink(missing_ok=True)
    save_png(fig, path)


def report(rows, variants, data_kinds, seeds, root: Path) -> str:
    lines = ["# MNIST-1D: structured (1-D impulse) init of a sequence transformer", "",
             "Generated by `run_comparison.py` beside this file from the runs in "
             f"`{root.relative_to(REPO) if root.is_relative_to(REPO) else root}`; every run is one "
             "`structinit train` process (one thread). Headline: **test accuracy after the last epoch**, "
             f"mean ± std over seeds {', '.join(map(str, seeds))}.", ""]
    for data in data_kinds:
        lines += [f"## {data.capitalize()} sequences", "",
                  "| model / init | test % (final epoch) | val % (final epoch) | paired vs trunc normal | "
                  "real-data hit rate at init | seconds per run (wall / CPU) |",
                  "|---|---|---|---|---|---|"]
        for v in variants:
            rs = [r for r in rows if r["variant"] == v and r["data"] == data]
            if not rs:
                continue
            t, ts = mean_std([r["test"] for r in rs])
            va, vs = mean_std([r["val"] for r in rs])
            p = paired(rows, v, REFERENCE, data) if v != REFERENCE else None
            pd = f"{p['mean']:+.1f} ± {p['std']:.1f} (se {p['se']:.1f}, n={p['n']})" if p else "—"
            hits = [r["init_hit_rate_real"] for r in rs if r["init_hit_rate_real"] is not None]
            hit = f"{mean_std(hits)[0]:.2f} (pseudo input {rs[0]['init_hit_rate_pseudo']:.2f})" if hits else "—"
            w, c = mean_std([r["wall_seconds"] for r in rs])[0], mean_std([r["cpu_seconds"] for r in rs])[0]
            lines.append(f"| {v} | **{t:.1f} ± {ts:.1f}** | {va:.1f} ± {vs:.1f} | {pd} | {hit} | {w:.0f} / {c:.0f} |")
        lines.append("")
        lines += ["Paired differences (same seed, test accuracy, mean ± std, standard error):", ""]
        for a, b in (("impulse-5", "trunc-normal"), ("impulse-5", "mimetic"), ("impulse-5", "cnn-1d"),
                     ("impulse-3", "mimetic"), ("impulse-9", "mimetic"), ("impulse-5", "impulse-5 Q/K only")):
            p = paired(rows, a, b, data)
            if p:
                lines.append(f"- {a} − {b}: {p['mean']:+.2f} ± {p['std']:.2f} (se {p['se']:.2f}, seeds "
                             f"{','.join(map(str, p['seeds']))})")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=REPO / "runs" / "mnist1d", help="where the run folders go")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--data", default=",".join(DATA))
    ap.add_argument("--report-only", action="store_true", help="only tabulate finished runs")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    data_kinds = [d for d in args.data.split(",") if d]
    unknown = sorted(set(variants) - set(VARIANTS)) + sorted(set(data_kinds) - set(DATA))
    if unknown:
        ap.error(f"unknown {', '.join(unknown)}")
    args.runs.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    rows = []
    # Seed-major order: every variant has its first seeds early, so a partial report is already paired.
    for seed in seeds:
        for data in data_kinds:
            for v in variants:
                if data != "plain" and v in PLAIN_ONLY:
                    continue
                out = run_dir(args.runs, v, data, seed)
                if args.report_only and not ((out / "final.json").exists() and (out / "timing.json").exists()):
                    continue
                row = run_one(v, data, seed, args.runs, log)
                rows.append(row)
                log(f"{v} {data} seed {seed}: test {row['test']:.2f}  val {row['val']:.2f}  "
                    f"{row['wall_seconds']:.0f}s wall, {row['cpu_seconds']:.0f}s CPU")
    (HERE / "results.json").write_text(json.dumps({"common": COMMON, "variants": VARIANTS, "data": DATA,
                                                  "rows": rows}, indent=1))
    if rows:
        figure(rows, HERE / "accuracy.png", [v for v in VARIANTS if v in variants], data_kinds)
        (HERE / "tables.md").write_text(report(rows, [v for v in VARIANTS if v in variants], data_kinds,
                                               sorted({r["seed"] for r in rows}), args.runs))
    log(f"{len(rows)} runs tabulated into {HERE}")


if __name__ == "__main__":
    main()
