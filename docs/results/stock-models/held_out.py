"""Hit rate per layer, at init, on 256 held-out real digits (the validation split of the stock-models
grid: never fitted to, never trained on), of the stock model (vit-digits with timm's learnable
trunc-normal position embedding) under each impulse variant of the grid, for seeds 0-4.

    OMP_NUM_THREADS=1 python docs/results/stock-models/held_out.py > docs/results/stock-models/held_out.md
    OMP_NUM_THREADS=1 python docs/results/stock-models/held_out.py impulse-pe2 impulse-pe4   # some variants only
"""

import warnings

import numpy as np
import torch

from structinit.analysis.fidelity import data_attention_quality
from structinit.geometry.grid import Grid
from structinit.init.initialize import initialize_model
from structinit.training.augment import normalize
from structinit.training.datasets import load_dataset, split_train
from structinit.training.models import ModelConfig, build_model

VARIANTS = {
    "impulse (plain call, data fit)": {},
    "impulse-noise (fit on noise, no data)": {"data_fit_inputs": "noise"},
    "impulse-own18 (fit_pe, pe_factor 18)": {"fit_pe": True, "pe_factor": 18.0},
    "impulse-pe2 (the plain call, sin-cos x2)": {"pe_scale": 2.0},
    "impulse-pe4 (the plain call, sin-cos x4)": {"pe_scale": 4.0},
}
SEEDS = range(5)


def main(only=None):
    torch.set_num_threads(1)
    data = split_train(load_dataset("digits"), None, 300, 0)
    info = data.info
    fit = normalize(data.train.images[:256], info.mean, info.std)  # what train fits to
    held = normalize(data.val.images[:256], info.mean, info.std)
    print("| pool | variant | layer 0 | layer 1 | layer 2 | layer 3 | min over layers and seeds |")
    print("|---|---|---|---|---|---|---|")
    for pool in ("avg", "token"):
        for name, params in VARIANTS.items():
            if only and name.split()[0] not in only:
                continue
            hits = []
            for seed in SEEDS:
                model = build_model(ModelConfig("vit-digits", pos_embed="learned", pool=pool), num_classes=10,
                                    image_size=8, in_chans=1, seed=seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rep = initialize_model(model, "impulse", data=fit, seed=seed, **params)
                q = data_attention_quality(model, held, [r["offsets"] for r in rep["layers"]], Grid((8, 8)))
                hits.append([r["hit_rate"] for r in q["layers"]])
            a = np.array(hits)
            cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(a.mean(0), a.std(0)))
            print(f"| {pool} | {name} | {cells} | {a.min():.3f} |", flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])  # the first words of variants to run (all without)
