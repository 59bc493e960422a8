"""The real-data hit rate per layer at init, as each training run recorded it (the epoch-0 line of
its metrics.jsonl: the fraction of the run's own training images on which each head's attention
peaks at its target offset, over up to 256 of them), per grid, init and training size.

    python docs/results/fashion/gpu/init_hit_rates.py RUNS_DIR > init_hit_rates.md

RUNS_DIR: a folder of run folders (bench grid's --out, or scripts/device_grid.py's grid.tar.gz
unpacked). Prints one markdown table per model (vit-fashion: 49 tokens; vit-fashion-196: 196 tokens):
the mean over seeds per layer, and the lowest seed's last layer.
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(f"error: give one folder of run folders, e.g. runs-gpu (got {' '.join(sys.argv[1:]) or 'nothing'})")
    runs = Path(sys.argv[1])
    table = defaultdict(list)  # (model, init, train size) -> [[hit rate per layer], ...]
    for run in sorted(runs.iterdir()):
        try:
            cfg = json.loads((run / "config.json").read_text())
            first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            continue
        att = first.get("init_attention") if first.get("epoch") == 0 else None
        if not att:
            continue
        c = cfg["config"]
        scale = (c.get("init_params") or {}).get("pe_scale")
        init = f"{c['init']} (table x{scale:g})" if scale else c["init"]
        table[(c["model"], init, c.get("train_size") or "all")].append([layer["hit_rate"] for layer in att["layers"]])
    for model in sorted({k[0] for k in table}, reverse=True):
        print(f"\n### {model}: hit rate per layer at init, on the run's training images\n")
        print("| init | training images | seeds | layer 1 | layer 2 | layer 3 | layer 4 | lowest seed, last layer |")
        print("|---|---|---|---|---|---|---|---|")
        def order(k):  # by init, then by size, "all" last
            return k[1], k[2] if isinstance(k[2], int) else 10**9

        keys = sorted((k for k in table if k[0] == model), key=order)
        for _, init, size in keys:
            rows = table[(model, init, size)]
            means = [statistics.mean(r[i] for r in rows) for i in range(len(rows[0]))]
            cells = " | ".join(f"{m:.3f}" for m in means)
            print(f"| {init} | {size} | {len(rows)} | {cells} | {min(r[-1] for r in rows):.3f} |")


if __name__ == "__main__":
    main()
