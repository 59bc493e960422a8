"""Paired differences of a report's runs.csv on the test AND the validation split.

``bench report`` pairs the final-epoch test accuracy with the baseline; choices are made on
validation, so this prints both, per column: the mean over seeds of (row - baseline) ± its standard
error (seeds finished in both), and each row's mean accuracy.

    python docs/results/conditioned/paired.py docs/results/conditioned/proxy/runs.csv \\
        --pair mimetic:impulse,conditioned,impulse-subspace,impulse-subspace-k4 \\
        --pair mimetic-pytorch:impulse-pytorch,conditioned-pytorch,impulse-2025
"""

import argparse
import csv
import math
from collections import defaultdict


def load(path):
    """``{(row, column): {seed: (test, val)}}`` of the finished runs."""
    runs = defaultdict(dict)
    for r in csv.DictReader(open(path)):
        if r["state"] == "finished" and r["final_acc"]:
            runs[(r["row_id"], r["column_id"])][int(r["seed"])] = (float(r["final_acc"]), float(r["final_val_acc"]))
    return runs


def mean_se(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def fmt(m, se, signed=True):
    head = f"{m:+.2f}" if signed else f"{m:.2f}"
    return head if math.isnan(se) else f"{head} ± {se:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs_csv")
    ap.add_argument("--pair", action="append", required=True, help="BASELINE:ROW,ROW,...")
    args = ap.parse_args()
    runs = load(args.runs_csv)
    columns = sorted({c for _, c in runs}, key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    print("| row (minus baseline) | column | test | validation | seeds | test accuracy | validation accuracy |")
    print("|---|---|---|---|---|---|---|")
    for pair in args.pair:
        base, rows = pair.split(":")
        for row in [base] + rows.split(","):
            for col in columns:
                a, b = runs.get((row, col), {}), runs.get((base, col), {})
                seeds = sorted(set(a) & set(b))
                if not seeds:
                    continue
                acc = [mean_se([a[s][i] for s in sorted(a)]) for i in (0, 1)]
                if row == base:
                    print(f"| {row} | {col} | | | {len(a)} | {fmt(*acc[0], False)} | {fmt(*acc[1], False)} |")
                    continue
                diff = [mean_se([a[s][i] - b[s][i] for s in seeds]) for i in (0, 1)]
                print(f"| {row} - {base} | {col} | {fmt(*diff[0])} | {fmt(*diff[1])} | {len(seeds)} | "
                      f"{fmt(*acc[0], False)} | {fmt(*acc[1], False)} |")


if __name__ == "__main__":
    main()
