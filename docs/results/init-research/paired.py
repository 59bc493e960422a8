"""Paired differences between two rows of a grid report, on the test and the validation split.

    python docs/results/init-research/paired.py RUNS_CSV ROW BASELINE [ROW BASELINE ...]

RUNS_CSV is the runs.csv that `structinit bench report` writes beside its report; each ROW and
BASELINE is a row id of that grid. For every column (train size), the runs of ROW and BASELINE with
the same seed are paired; the table gives the mean of (ROW - BASELINE) over those seeds with its
standard error, the seeds in which ROW is ahead, and the same difference on the validation split
(the split every choice here was made on). Prints one markdown table.
"""
import csv
import math
import statistics
import sys


def _accuracies(path):
    """{(row, column, seed): (final test acc, final val acc)} of the finished runs."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["state"] == "finished" and r["final_acc"]:
                val = float(r["final_val_acc"]) if r["final_val_acc"] else math.nan
                out[(r["row_id"], r["column_id"], int(r["seed"]))] = (float(r["final_acc"]), val)
    return out


def _mean_se(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:+.2f}"
    return f"{statistics.mean(values):+.2f} ± {statistics.stdev(values) / math.sqrt(len(values)):.2f}"


def _column_order(column):
    """Train sizes in numeric order, ``all`` last, within each other axis (``avg/100``, ``avg/250``...)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in column.split("/")[::-1]][::-1]


def main(argv):
    if len(argv) < 3 or len(argv) % 2 == 0:
        sys.exit(__doc__)
    acc = _accuracies(argv[0])
    columns = sorted({c for _, c, _ in acc}, key=_column_order)
    print("| row − baseline | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row, base in zip(argv[1::2], argv[2::2]):
        cells = []
        for c in columns:
            seeds = sorted(s for (r, cc, s) in acc if r == row and cc == c and (base, c, s) in acc)
            test = [acc[(row, c, s)][0] - acc[(base, c, s)][0] for s in seeds]
            val = [acc[(row, c, s)][1] - acc[(base, c, s)][1] for s in seeds]
            ahead = sum(d > 0 for d in test)
            cells.append(f"{_mean_se(test)} ({ahead}/{len(seeds)} ahead; val {_mean_se(val)})" if seeds else "-")
        print(f"| {row} − {base} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
