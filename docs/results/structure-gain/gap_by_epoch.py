"""Hypothesis: the impulse init's lead is a head start that training erases. Per evaluated epoch, the
paired difference impulse - mimetic (both on the same base of the other weights; mean ± standard error
over the seeds both finished) in validation and test accuracy, read from each run's ``metrics.jsonl``
through the report's reader. The runs are the structure-gain grid's, in the folder it trained into.

    python docs/results/structure-gain/gap_by_epoch.py runs > docs/results/structure-gain/gap_by_epoch.md
"""

import statistics
import sys
from pathlib import Path

from structinit.experiments.expand import expand
from structinit.experiments.gridspec import load_grid
from structinit.experiments.report import collect

GRID = Path(__file__).resolve().parent / "grid.toml"
PAIRS = (("impulse", "mimetic", "model"), ("impulse-base-mlp", "mimetic-base-mlp", "pytorch-mlp"))
SIZES = ("250", "1000", "5000")


def per_seed(rep, row, column):
    """``{seed: {epoch: record}}`` of ``row``'s finished runs in ``column`` that kept their metrics."""
    return {r.seed: {m["epoch"]: m for m in r.metrics if "val_acc" in m}
            for r in rep.runs if r.row == row and r.column == (column,) and r.final_acc is not None and r.metrics}


def spread(values):
    if len(values) < 2:
        return f"{values[0]:+.2f}" if values else "—"
    return f"{statistics.mean(values):+.2f} ± {statistics.stdev(values) / len(values) ** 0.5:.2f}"


def main(runs_dir: str) -> None:
    rows = sorted({r for pair in PAIRS for r in pair[:2]})
    rep = collect(expand(load_grid(GRID), runs_dir=runs_dir, seeds=10, only={"init": rows, "train_size": list(SIZES)}))
    print("# Impulse - mimetic per epoch, on the same base (Fashion-MNIST, 49 tokens)\n")
    print("Mean ± standard error over the seeds both finished with their per-epoch metrics; points of "
          "accuracy.\n")
    for impulse, mimetic, base in PAIRS:
        for size in SIZES:
            a, b = per_seed(rep, impulse, size), per_seed(rep, mimetic, size)
            seeds = sorted(set(a) & set(b))
            if not seeds:
                continue
            print(f"## base {base}, {size} images ({len(seeds)} seeds)\n")
            print("| epoch | val_acc | test_acc |\n|---|---|---|")
            for epoch in sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds))):
                cells = [spread([a[s][epoch][k] - b[s][epoch][k] for s in seeds]) for k in ("val_acc", "test_acc")]
                print(f"| {epoch} | " + " | ".join(cells) + " |")
            print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs")
