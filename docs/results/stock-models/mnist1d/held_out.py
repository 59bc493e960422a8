"""Hit rate per layer, at init, on 256 held-out MNIST-1D sequences (the validation split of the
stock-mnist1d grid: never fitted to, never trained on), of transformer-1d with a learnable
trunc-normal position embedding (the stock model) and with the fixed 1-D sin-cos table (the
reference), under the grid's two impulse rows (the data fit on real sequences, the fit on noise),
seeds 0-4.

    cd docs/results/stock-models/mnist1d && OMP_NUM_THREADS=1 python held_out.py > held_out.md
"""

import warnings

import numpy as np
import torch

from structinit.analysis.fidelity import data_attention_quality
from structinit.geometry.grid import Grid
from structinit.init.initialize import initialize_model
from structinit.training.datasets import load_dataset, split_train
from structinit.training.models import ModelConfig, build_model

VARIANTS = {
    "impulse 5, the plain call (data fit)": {"filter": 5, "data_fit": 300},
    "impulse 5 fitted on noise (no data)": {"filter": 5, "data_fit": 300, "data_fit_inputs": "noise"},
}
SEEDS = range(5)


def main():
    torch.set_num_threads(1)
    data = split_train(load_dataset("mnist1d"), None, 500, 0)
    info = data.info
    fit = data.train.images[:256]  # what train fits to (sequences are used as stored: standardized)
    held = data.val.images[:256]
    print("| position embedding | variant | layer 0 | layer 1 | layer 2 | layer 3 | min over layers and seeds |")
    print("|---|---|---|---|---|---|---|")
    for pos_embed in ("learned", "sincos"):
        for name, params in VARIANTS.items():
            hits = []
            for seed in SEEDS:
                model = build_model(ModelConfig("transformer-1d", pos_embed=pos_embed), num_classes=10,
                                    image_size=info.image_size, in_chans=1, seed=seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rep = initialize_model(model, "impulse", data=fit, seed=seed, **params)
                q = data_attention_quality(model, held, [r["offsets"] for r in rep["layers"]],
                                           Grid((info.image_size,)))
                hits.append([r["hit_rate"] for r in q["layers"]])
            a = np.array(hits)
            cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(a.mean(0), a.std(0)))
            label = "learnable (stock)" if pos_embed == "learned" else "fixed sin-cos (reference)"
            print(f"| {label} | {name} | {cells} | {a.min():.3f} |", flush=True)


if __name__ == "__main__":
    main()
