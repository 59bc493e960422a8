"""Hypothesis: the impulse init's lead is a head start that training erases. Each init's attention
structure, epoch by epoch, beside its validation accuracy: the structure-gain grid's runs at 1,000
images (vit-fashion, 49 tokens, 40 epochs), trained here with a callback that reads the checkpoint
each epoch writes and measures, on 256 validation images, every layer's share of attention inside
the 3x3 window around each query (window mass: the locality a convolution has; mimetic, which
attends to the query itself, scores on it too) and, for the impulse inits, the hit rate of the
offsets the init wrote.

    OMP_NUM_THREADS=1 python docs/results/structure-gain/per_epoch.py --seeds 3 \
        > docs/results/structure-gain/per_epoch.md
"""

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from structinit.analysis.fidelity import attention_fidelity, offsets_from_report
from structinit.experiments.expand import expand
from structinit.experiments.gridspec import load_grid
from structinit.training.loop import train
from structinit.training.run_models import initialized_model
from structinit.training.rundir import load_run_weights

GRID = Path(__file__).resolve().parent / "grid.toml"
ROWS = ("mimetic", "impulse", "impulse-subspace", "impulse-subspace-k4")


def measure(model, images, offsets):
    fid = attention_fidelity(model, images, offsets=offsets, filter=3, keep_maps=False)
    rows = fid.layer_rows()
    window = float(np.mean([r["window_mass"] for r in rows]))
    hits = float(np.mean([r["hit_rate"] for r in rows])) if offsets is not None else None
    return window, hits


def one_run(config, images):
    """Per epoch (0 = at init): (validation accuracy, mean window mass, mean hit rate)."""
    model, report, _ = initialized_model(config)
    offsets = offsets_from_report(report) if str(report.get("method", "")).startswith("impulse") else None
    out = [(None, *measure(model, images, offsets))]

    def on_epoch(record):
        ck = load_run_weights(Path(config.out) / "checkpoint.pt")
        model.load_state_dict(ck["state_dict"])
        out.append((record.get("val_acc"), *measure(model, images, offsets)))

    train(config, on_epoch=on_epoch)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--size", default="1000")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ex = expand(load_grid(str(GRID)), seeds=args.seeds, only=[f"init={','.join(ROWS)}", f"train_size={args.size}"])
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset, split_train

    curves = {}
    for cell in ex.cells:
        config = cell.config
        data = split_train(load_dataset(config.dataset), val_size=config.val_size)
        images = normalize(data.val.images[:256], data.info.mean, data.info.std)
        with tempfile.TemporaryDirectory() as out:
            config.out, config.resume = out, False
            curves.setdefault(cell.row, []).append(one_run(config, images))
        print(f"done {cell.row} seed {cell.seed}", file=sys.stderr, flush=True)
    epochs = len(next(iter(curves.values()))[0])
    print(f"# Attention structure epoch by epoch ({args.size} images, vit-fashion, {args.seeds} seeds)\n")
    print(f"Command: `OMP_NUM_THREADS=1 python docs/results/structure-gain/per_epoch.py --seeds {args.seeds}`. "
          "Mean over seeds and layers; window: share of attention in the 3x3 window around the query; hit: the "
          "impulse offsets' hit rate; val: validation accuracy (%).\n")
    head = "| epoch | " + " | ".join(f"{r} val | {r} window | {r} hit" for r in ROWS) + " |"
    print(head + "\n|---|" + "---|" * (3 * len(ROWS)))
    show = sorted({0, 1, 2, 3, 5, 10, 20, epochs - 1})
    for e in show:
        cells = []
        for r in ROWS:
            vals = np.array([[np.nan if v is None else v for v in run[e]] for run in curves[r]], dtype=float)
            m = np.nanmean(vals, axis=0) if not np.all(np.isnan(vals)) else [np.nan] * 3
            cells += [f"{m[0]:.2f}" if np.isfinite(m[0]) else "—", f"{m[1]:.3f}",
                      f"{m[2]:.3f}" if np.isfinite(m[2]) else "—"]
        print(f"| {e} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
