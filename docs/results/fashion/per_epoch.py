"""Where the default's lead over mimetic goes on all 55,000 images (49 tokens): per epoch, the paired
difference (default - mimetic, mean ± standard error over the seeds both have finished) in training
loss and accuracy (on the augmented training batches) and in validation and test accuracy, read from
each run's own ``metrics.jsonl`` through the report's reader.

    python docs/results/fashion/per_epoch.py runs      # the folder the shipped `fashion` grid trained into
"""

import statistics
import sys

from structinit.experiments.expand import expand
from structinit.experiments.gridspec import load_grid
from structinit.experiments.report import collect

KEYS = ("train_loss", "train_acc", "val_acc", "test_acc")


def per_seed(rep, row):
    """``{seed: {epoch: record}}`` of ``row``'s finished runs on all 55,000 images."""
    return {r.seed: {m["epoch"]: m for m in r.metrics}
            for r in rep.runs if r.row == row and r.column == ("all",) and r.final_acc is not None}


def main(runs_dir: str) -> None:
    ex = expand(load_grid("fashion"), runs_dir=runs_dir, seeds=10,
                only={"init": ["mimetic", "impulse"], "train_size": ["all"]})
    rep = collect(ex)
    base, default = per_seed(rep, "mimetic"), per_seed(rep, "impulse")
    seeds = sorted(set(base) & set(default))
    print(f"default - mimetic on all 55,000 images, {len(seeds)} paired seeds ({', '.join(map(str, seeds))})\n")
    print("| epoch | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for epoch in sorted(set(base[seeds[0]]) - {0}):
        cells = []
        for key in KEYS:
            d = [default[s][epoch][key] - base[s][epoch][key] for s in seeds]
            cells.append(f"{statistics.mean(d):+.3f} ± {statistics.stdev(d) / len(d) ** 0.5:.3f}")
        print(f"| {epoch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs")
