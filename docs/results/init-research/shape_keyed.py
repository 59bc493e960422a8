"""Can one Q/K per shape, fitted once, serve every model of that shape? The held-out hit rate per
layer, at init, on 256 real digits (the validation split of the digits grids: never fitted to,
never trained on), of models the Q/K were never fitted through.

Candidates (each on vit-digits: dim 64, 4 layers, 4 heads, 8x8 tokens, fixed sin-cos table; Q/K
written with each model's own mimetic V/proj, as the default init writes them):

- ``plain``: the plain solve on the position table (the shape-keyed artifact `solve` writes today);
- ``own fit``: the default, fitted through each model itself on noise inputs (the per-model cost);
- ``ensemble M``: the data fit run once through M other models of the shape at the same time
  (M random draws of the preset's init, seeds 1000..1000+M-1, noise inputs; each layer refined on
  the inputs of all M models, with the same Q/K written into all of them), then copied into the
  test models: one artifact for the shape and its init's distribution, no fit per model.

    OMP_NUM_THREADS=1 python docs/results/init-research/shape_keyed.py > docs/results/init-research/shape_keyed.md
"""

import sys
import warnings

import numpy as np
import torch

from structinit.analysis.capture import LayerInputs, projection_module
from structinit.analysis.fidelity import data_attention_quality
from structinit.fit import refine
from structinit.fit.inputs import noise_inputs
from structinit.fit.layers import prefixed_columns
from structinit.geometry.grid import Grid
from structinit.geometry.targets import impulse_columns
from structinit.init.attention_target import AttentionTarget
from structinit.init.impulse_write import ImpulseWriter
from structinit.init.initialize import initialize_model
from structinit.init.inject import read_qk, write_qk
from structinit.init.registry import init_spec
from structinit.training.augment import normalize
from structinit.training.datasets import load_dataset, split_train
from structinit.training.models import ModelConfig, build_model

TEST_SEEDS = range(5)
SAMPLES = 256  # noise inputs in all, as the default fit uses


def model(seed):
    return build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=seed)


def ensemble_fit(spec, plain, members, seed=0):
    """Q/K ``[L, H, D, d]`` fitted once through every model of ``members`` (each written as it goes,
    with its own mimetic V/proj: the members are left initialized with the ensemble's Q/K)."""
    targets = [AttentionTarget(m) for m in members]
    writers = [ImpulseWriter(spec, t, plain, seed + i) for i, t in enumerate(targets)]  # each its own V/proj
    per = max(1, SAMPLES // len(members))
    inputs = [LayerInputs(t.model, noise_inputs((1, 8, 8), per, seed + 17 * i).x,
                          [projection_module(t.model, s.q.key) for s in t.det.slots])
              for i, t in enumerate(targets)]
    s = spec.fit_settings()
    q_all, k_all = [], []
    for layer, slot in enumerate(targets[0].slots):
        start = [w.prepare(slot) for w in writers][0]  # plain Q/K (the same in all) and each one's V/proj
        x = torch.cat([inp(layer) for inp in inputs])
        cols = prefixed_columns(impulse_columns(Grid((8, 8)), plain.offsets[layer], "zero"), x.shape[1])
        q, k = refine.refine_qk_minibatch(x, *start, cols, steps=s.steps, mass=s.mass, l2=s.l2, lr=s.lr,
                                          norm=s.norm, seed=seed * 1_000_003 + layer)
        q, k = refine.calibrate(x, q, k, cols, s.calibrated_to)
        for t in targets:
            write_qk(t.sd, slot, q, k)
        q_all.append(q)
        k_all.append(k)
    return torch.stack(q_all), torch.stack(k_all)


def held_out_hits(m, rep_layers, held):
    q = data_attention_quality(m, held, [r["offsets"] for r in rep_layers], Grid((8, 8)))
    return [r["hit_rate"] for r in q["layers"]]


def copied(spec, plain, q, k, seed, held):
    """Hit rates on ``held`` of test model ``seed`` with ``q, k`` (solved for ``plain``'s offsets)
    written, and its own mimetic V/proj (drawn from its seed, as train draws them)."""
    m = model(seed)
    rep = initialize_model(m, spec, artifact=plain, data_fit=0, seed=seed)
    t = AttentionTarget(m)
    for i, slot in enumerate(t.slots):
        write_qk(t.sd, slot, q[i], k[i])
        assert torch.allclose(read_qk(t.sd, slot, t.heads)[0], q[i])
    return held_out_hits(m, rep["layers"], held)


def main(sizes=(1, 4, 16)):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    data = split_train(load_dataset("digits"), None, 300, 0)
    held = normalize(data.val.images[:256], data.info.mean, data.info.std)
    spec = init_spec("impulse")
    plain = spec.artifact_for(AttentionTarget(model(0)))[0]
    rows = {}
    rows["plain (the shape's solve, no fit)"] = [copied(spec, plain, torch.from_numpy(plain.q),
                                                        torch.from_numpy(plain.k), s, held) for s in TEST_SEEDS]
    own = []
    for s in TEST_SEEDS:
        m = model(s)
        rep = initialize_model(m, spec, seed=s)
        own.append(held_out_hits(m, rep["layers"], held))
    rows["own fit (each model, noise inputs: the default)"] = own
    for size in sizes:
        members = [model(1000 + i) for i in range(size)]
        q, k = ensemble_fit(spec, plain, members)
        rows[f"ensemble of {size}: its own members (fitted through)"] = [
            held_out_hits(m, [{"offsets": plain.offsets[i].tolist()} for i in range(4)], held)
            for m in members[:len(TEST_SEEDS)]]
        rows[f"ensemble of {size} other model(s), copied"] = [copied(spec, plain, q, k, s, held) for s in TEST_SEEDS]
    print("| Q/K | layer 0 | layer 1 | layer 2 | layer 3 | min over layers and models |")
    print("|---|---|---|---|---|---|")
    for name, hits in rows.items():
        a = np.array(hits)
        cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(a.mean(0), a.std(0)))
        print(f"| {name} | {cells} | {a.min():.3f} |", flush=True)


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1, 4, 16))
