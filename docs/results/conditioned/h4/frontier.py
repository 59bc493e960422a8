"""Structure against accuracy on the stand-in (2,000 images): for each row with impulse offsets in
every layer, the lowest layer's held-out hit rate (the per-layer mean over seeds 0-4, from
structure.txt) against its validation accuracy minus mimetic's (paired by seed, mean ± standard
error, from the report's runs.csv); the content scale of the split heads (H4) as the colour.

    python docs/results/conditioned/h4/frontier.py docs/results/conditioned/proxy/runs.csv \\
        docs/results/conditioned/h4/structure.txt docs/results/conditioned/h4/frontier.png
"""

import csv
import math
import sys
from collections import defaultdict

#: Rows plotted: (structure.txt section, runs.csv row, label, content scale or None).
ROWS = [
    ("default-data", "impulse", "the default (whole stream)", None),
    ("k4", "impulse-subspace-k4", "subspace, 4 directions", None),
    ("h4-mimetic-s0.1", "h4-mimetic-s0.1", "H4 mimetic", 0.1),
    ("h4-mimetic-s0.3", "h4-mimetic-s0.3", "H4 mimetic", 0.3),
    ("h4-mimetic-s1", "h4-mimetic-s1", "H4 mimetic", 1.0),
    ("h4-conditioned-s0.1", "h4-conditioned-s0.1", "H4 conditioned", 0.1),
    ("h4-conditioned-s0.3", "h4-conditioned-s0.3", "H4 conditioned", 0.3),
    ("h4-conditioned-s0.5", "h4-conditioned-s0.5", "H4 conditioned", 0.5),
    ("h4-conditioned-s1", "h4-conditioned-s1", "H4 conditioned", 1.0),
    ("h4-conditioned-zk", "h4-conditioned-zk", "H4 conditioned, zero keys", None),
    ("k4-noise", "impulse-subspace-k4-noise", "subspace, 4 directions, no data", None),
    ("h6-conditioned-m0.6", "h6-conditioned-m0.6", "H6: H4 conditioned x1, target mass 0.6", None),
    ("h6-conditioned-m0.9", "h6-conditioned-m0.9", "H6: H4 conditioned x1, target mass 0.9", None),
    ("h4-conditioned-v", "h4-conditioned-v", "H4 conditioned x1, conditioned V", None),
    ("h6-conditioned-m0.9-v", "h6-conditioned-m0.9-v", "H6, conditioned V", None),
]


#: Where a row's label sits (points from its marker), where the default would overlap another.
OFFSETS = {"h4-mimetic-s1": (8, 6), "h4-conditioned-s0.5": (-118, 4), "h4-conditioned-zk": (8, 16),
           "k4": (8, -14), "k4-noise": (8, 1), "h6-conditioned-m0.6": (8, -16),
           "h4-mimetic-s0.3": (-98, -3), "h4-conditioned-s0.1": (8, -12)}


def lowest_layer(path):
    """``{section: lowest per-layer mean hit rate}`` of structure.txt."""
    seen, section = defaultdict(list), None
    for line in open(path):
        if line.startswith("## "):
            section = line[3:].strip()
        elif "hit rate" in line and section:
            seen[section].append([float(x) for x in line.rsplit(":", 1)[1].split()])
    return {k: min(sum(col) / len(col) for col in zip(*rows)) for k, rows in seen.items()}


def paired_validation(path, column="2000"):
    """``{row: (mean, standard error)}`` of validation accuracy minus mimetic's, paired by seed."""
    runs = defaultdict(dict)
    for r in csv.DictReader(open(path)):
        if r["state"] == "finished" and r["column_id"] == column and r["final_val_acc"]:
            runs[r["row_id"]][int(r["seed"])] = float(r["final_val_acc"])
    out = {}
    for row, seeds in runs.items():
        d = [v - runs["mimetic"][s] for s, v in seeds.items() if s in runs["mimetic"]]
        if len(d) > 1:
            m = sum(d) / len(d)
            out[row] = (m, math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)))
    return out


def main(runs_csv, structure_txt, out_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hit, acc = lowest_layer(structure_txt), paired_validation(runs_csv)
    fig, ax = plt.subplots(figsize=(10, 6.5), layout="constrained")
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.LogNorm(vmin=0.1, vmax=1.0)
    for section, row, label, scale in ROWS:
        if section not in hit or row not in acc:
            continue
        x, (y, se) = hit[section], acc[row]
        colour = cmap(norm(scale)) if scale is not None else "0.4"
        marker = "s" if "mimetic" in label else ("o" if scale is not None else "D")
        ax.errorbar(x, y, yerr=se, fmt=marker, color=colour, ecolor=colour, capsize=3, markersize=9)
        ax.annotate(label if scale is None else f"{label} x{scale:g}", (x, y), textcoords="offset points",
                    xytext=OFFSETS.get(section, (8, -3)), fontsize=8)
    ax.axhline(0.0, color="0.6", lw=0.8)
    ax.axhline(0.5, color="tab:red", lw=0.8, ls="--", label="mimetic + 0.5 (the floor)")
    ax.axvline(0.9, color="tab:blue", lw=0.8, ls=":", label="every layer at 0.9 (the floor)")
    ax.set_xlabel("lowest layer's held-out hit rate at init (mean of seeds 0-4, 256 test images)")
    ax.set_ylabel("validation accuracy minus mimetic (points, ± s.e.)")
    ax.set_title("Structure at init against accuracy: the stand-in at 2,000 images, crops and flips\n"
                 "(squares: H4 with mimetic content; circles: conditioned content; diamonds: other inits)")
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label="content_scale of the split heads (H4)")
    ax.legend(loc="lower left", fontsize=8)
    fig.savefig(out_png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
