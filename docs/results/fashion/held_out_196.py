"""Hit rate per layer, at init, of the default impulse init (and of the sin-cos table x2) on
`vit-fashion-196` (patch 2: 14x14 = 196 tokens), measured on 256 held-out Fashion-MNIST images (the
validation split of the grid at 2,000 images: never fitted to, never trained on), seeds 0-1; with
the mean seconds of the whole init on one CPU thread.

    OMP_NUM_THREADS=1 python docs/results/fashion/held_out_196.py > docs/results/fashion/held_out_196.md
"""
import time
import warnings

import numpy as np
import torch

from structinit.analysis.fidelity import data_attention_quality
from structinit.geometry.grid import Grid
from structinit.init.specs import initialize_model
from structinit.training.augment import normalize
from structinit.training.datasets import DATASETS, load_dataset, split_train
from structinit.training.models import ModelConfig, build_model

torch.set_num_threads(1)
info = DATASETS["fashion-mnist"]
data = split_train(load_dataset("fashion-mnist"), 2000, 5000, 0)
fit = normalize(data.train.images[:256], info.mean, info.std)
held = normalize(data.val.images[:256], info.mean, info.std)
print("| fit | layer 0 | layer 1 | layer 2 | layer 3 | min | init s |")
print("|---|---|---|---|---|---|---|")
for name, params in (("default (table x1)", {}), ("pe_scale=2 (table x2)", {"pe_scale": 2.0})):
    hits, secs = [], []
    for seed in range(2):
        model = build_model(ModelConfig("vit-fashion-196"), num_classes=10, image_size=28, in_chans=1,
                            default_patch=info.default_patch, seed=seed)
        t0=time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = initialize_model(model, "impulse", data=fit, seed=seed, **params)
        secs.append(time.perf_counter()-t0)
        q = data_attention_quality(model, held, [r["offsets"] for r in rep["layers"]], Grid((14, 14)))
        hits.append([r["hit_rate"] for r in q["layers"]])
    a = np.array(hits)
    cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(a.mean(0), a.std(0)))
    print(f"| {name} | {cells} | {a.min():.3f} | {np.mean(secs):.0f} |", flush=True)
