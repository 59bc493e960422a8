"""Is the impulse init structured on the models people train? Stock timm ViT-T/S/B at 224 with
16x16 patches (class token, learned position embedding), initialized through the public API
(``initialize_model``), without data (the default) and with data (256 random 224-pixel crops of one
of scikit-learn's two sample photos); the hit rate of every layer is measured on 64 crops of the
*other* photo, which no fit saw (ImageNet normalization).

One table per hypothesis (see README.md). Run (one torch thread; about an hour on this CPU):

    OMP_NUM_THREADS=1 python docs/results/patch16/structure.py > docs/results/patch16/structure.md

``--only NAME`` runs one section (``hypotheses``, ``depth``, ``models``, ``small``, ``peers``);
``--model NAME`` runs the model sections on one timm model; ``--rows A,B`` runs those rows of
``peers`` only (its labels' first words: mimetic, conditioned, impulse-2025, default, subspace, mixed, h4).

``peers`` (every peer on ViT-T/16 and ViT-S/16, two measures per layer, held out):

    OMP_NUM_THREADS=1 python docs/results/patch16/structure.py --only peers
"""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import crops, dead_leaves, held_out_hits, pink_noise, stock  # noqa: E402

from structinit.init.initialize import initialize_model  # noqa: E402
from structinit.init.position_subspace import PositionSubspace  # noqa: E402

ONLY_MODEL = None  # --model
ONLY_ROWS = None  # --rows
FIT_PHOTO, CHECK_PHOTO = 1, 0  # flower: what a fit may see; china: held out


def fit_data(kind, shape=(3, 224, 224)):
    return {"none": lambda: None, "data": lambda: crops(FIT_PHOTO, 256, seed=2),
            "pink": lambda: pink_noise(256, shape, 3), "dead leaves": lambda: dead_leaves(256, shape, 3)}[kind]()


def run(name, data="none", seed=0, **params):
    """Initialize a fresh stock ``name`` and measure it: (per-layer held-out hits, seconds, report)."""
    import tempfile

    model = stock(name, seed)
    x = fit_data(data)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as cache:  # a fresh cache: the whole cost
        warnings.simplefilter("ignore")
        os.environ["STRUCTINIT_CACHE"] = cache
        report = initialize_model(model, "impulse", data=x, seed=seed, **params)
    seconds = time.perf_counter() - t0
    return held_out_hits(model, report, crops(CHECK_PHOTO, 64, seed=1)), seconds, report


def report_offsets(report):
    """``{layer: offsets [heads, 2]}`` of an init report: an impulse init's every layer, a mixed
    init's lower part's layers below its ``split_layer``; ``{}`` for an init without offsets."""
    if report.structure is not None:
        return {int(k): np.asarray(v) for k, v in report.structure.offsets.items()}
    if report.get("method") != "mixed":
        return {}
    split = report.get("split_layer")
    return {int(r["layer"]): np.asarray(r["offsets"]) for r in (report.get("lower") or {}).get("layers", [])
            if "offsets" in r and r["layer"] < split}


def run_peer(name, method, seed=0, **params):
    """Initialize a fresh stock ``name`` with ``method`` (no data) and measure it on the held-out
    crops: (per-layer hit rate on its offsets, NaN where a layer has none; per-layer share of the
    attention inside the 3x3 window around each grid query; seconds of the init)."""
    import tempfile

    from structinit.analysis.fidelity import attention_fidelity

    model = stock(name, seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as cache:  # a fresh cache: the whole cost
        warnings.simplefilter("ignore")
        os.environ["STRUCTINIT_CACHE"] = cache
        report = initialize_model(model, method, seed=seed, **params)
    seconds = time.perf_counter() - t0
    offsets = report_offsets(report)
    fid = attention_fidelity(model, crops(CHECK_PHOTO, 64, seed=1), offsets=offsets or None, filter=3,
                             keep_maps=False)
    depth_ = fid.window_mass.shape[0]
    hits = np.array([np.nanmean(fid.hit_rate[i]) if fid.hit_rate is not None and i in offsets else np.nan
                     for i in range(depth_)])
    return hits, fid.window_mass.mean(1), seconds


PEERS = [
    ("mimetic", "mimetic", {}),
    ("conditioned", "conditioned", {}),
    ("impulse-2025", "impulse-2025", {}),
    ("subspace: the default with position_subspace=true, no data", "impulse", dict(position_subspace=True)),
    ("mixed (H1): the default impulse below split_layer = depth/2, mimetic above, no data", "mixed", {}),
    ("default impulse, no data (fitted on noise)", "impulse", {}),
    ("h4: heads split by direction (position_subspace=true, position_dims=16, content_qk=conditioned), no data",
     "impulse", dict(position_subspace=True, position_dims=16, content_qk="conditioned")),
]


def _cells(values):
    finite = values[np.isfinite(values)]
    if not finite.size:
        return "- | - | " + " | ".join("-" for _ in values)
    return f"{finite.min():.2f} | {finite.mean():.2f} | " + " | ".join(
        "-" if not np.isfinite(v) else f"{v:.2f}" for v in values)


def peers():
    """Every peer at init on ViT-T/16 and ViT-S/16 (no data): held-out hit rate on the init's own
    offsets (where it has them) and the 3x3 window share (every row), per layer."""
    print("## Every peer at init on ViT-T/16 and ViT-S/16, no data (held out)\n")
    for name in ("vit_tiny_patch16_224", "vit_small_patch16_224"):
        if ONLY_MODEL not in (None, name):
            continue
        print(f"### `{name}`\n\nhit rate on the init's offsets (min, mean over the layers that have them), "
              f"then the 3x3 window share; per layer 0-11; init s\n")
        cols = " | ".join(str(i) for i in range(12))
        print(f"| init | hit min | hit mean | {cols} | window min | window mean | {cols} | init s |\n"
              "|---|" + "---|" * 29, flush=True)
        for label, method, params in PEERS:
            if ONLY_ROWS and label.split(":")[0].split(" ")[0] not in ONLY_ROWS:
                continue
            hits, window, secs = run_peer(name, method, **params)
            print(f"| {label} | {_cells(hits)} | {_cells(window)} | {secs:.0f} |", flush=True)
        print()


def row(label, hits, seconds=None):
    cells = " | ".join(f"{h:.2f}" for h in hits)
    extra = f" | {seconds:.0f}" if seconds is not None else ""
    return f"| {label} | {hits.min():.2f} | {hits.mean():.2f} | {cells}{extra} |"


def header(depth, seconds=True):
    cols = " | ".join(str(i) for i in range(depth))
    tail = " | init s" if seconds else ""
    return (f"| init | min | mean | {cols}{tail} |\n|---|---|---|" + "---|" * depth + ("---|" if seconds else ""))


class _Without:
    """Turn off one of the subspace's projections (an ablation)."""

    def __init__(self, method):
        self.method, self.saved = method, getattr(PositionSubspace, method)

    def __enter__(self):
        setattr(PositionSubspace, self.method, lambda *a, **k: None)

    def __exit__(self, *exc):
        setattr(PositionSubspace, self.method, self.saved)


def hypotheses():
    name = "vit_tiny_patch16_224"
    print(f"## Hypotheses on ViT-T/16 (`{name}`), held-out hit rate per layer\n")
    sections = [
        ("Pseudo inputs with natural-image statistics for the data-free fit (the whole stream, as today)", [
            ("white noise N(0, 1) (the default, no data)", dict(data="none")),
            ("1/f (pink) noise images", dict(data="pink")),
            ("dead-leaves images", dict(data="dead leaves")),
            ("real crops of the other photo (`data`)", dict(data="data")),
        ]),
        ("The scale of the written position table (the whole stream, no data)", [
            ("sin-cos table x1 (the default)", dict()),
            ("x2", dict(pe_scale=2.0)),
            ("x4", dict(pe_scale=4.0)),
        ]),
        ("A position subspace of k dimensions (table energy of the full table x1: gain sqrt(D/k); no data)", [
            ("k = 4 (the size that wins on the Fashion-MNIST stand-in's 4x4 grid)",
             dict(position_subspace=True, position_dims=4)),
            ("k = 8", dict(position_subspace=True, position_dims=8)),
            ("k = 16", dict(position_subspace=True, position_dims=16)),
            ("k = 32", dict(position_subspace=True, position_dims=32)),
            ("k = 48 (the default size: min(head dim, D/4))", dict(position_subspace=True)),
            ("k = 64", dict(position_subspace=True, position_dims=64)),
            ("k = 48, table x0.5 (pe_scale)", dict(position_subspace=True, pe_scale=0.5)),
            ("k = 48, with data", dict(position_subspace=True, data="data")),
        ]),
    ]
    for title, configs in sections:
        print(f"### {title}\n\n{header(12)}")
        for label, cfg in configs:
            hits, secs, _ = run(name, **cfg)
            print(row(label, hits, secs), flush=True)
        print()
    print("### Fitting more than Q/K: which of the subspace's projections carry the structure (k = 48, no data)\n")
    print(header(12))
    hits, secs, _ = run(name, position_subspace=True)
    print(row("all: the embedding (patch + class token) and every layer's writers", hits, secs), flush=True)
    with _Without("project_layer"):
        hits, secs, _ = run(name, position_subspace=True)
    print(row("the embedding only (attention and MLP outputs not projected)", hits, secs), flush=True)
    with _Without("project_embedding"):
        hits, secs, _ = run(name, position_subspace=True)
    print(row("the layers' writers only (patch embedding not projected)", hits, secs), flush=True)
    print()


def small():
    """The smaller subspaces that train at or above mimetic on the Fashion-MNIST proxy (4 of its 48
    directions): how structured ViT-T/S/B are with a subspace of a twelfth of the stream."""
    print("## Smaller subspaces: a twelfth of the stream\n")
    for name, k in (("vit_tiny_patch16_224", 16), ("vit_small_patch16_224", 32), ("vit_base_patch16_224", 64)):
        if ONLY_MODEL not in (None, name):
            continue
        print(f"### `{name}`, k = {k}\n\n{header(12)}")
        for label, cfg in (("no data", dict()), ("data", dict(data="data")), ("no data, table x2 (pe_scale 2)",
                                                                          dict(pe_scale=2.0))):
            hits, secs, _ = run(name, position_subspace=True, position_dims=k, **cfg)
            print(row(label, hits, secs), flush=True)
        print()


def position_share(model, x):
    """Per layer, the share of the LayerNorm'd attention input's energy that is the position part (the
    mean over the images of each token's input) and the share of the rest."""
    from structinit.analysis.capture import attention_inputs

    out = []
    for inp in attention_inputs(model, x):
        grid_rows = inp[:, 1:]  # drop the class token
        pos = grid_rows.mean(0, keepdim=True)
        out.append(float((pos ** 2).sum() * grid_rows.shape[0] / (grid_rows ** 2).sum()))
    return np.array(out)


def depth():
    name = "vit_tiny_patch16_224"
    print("## Where structure is lost with depth, and why (ViT-T/16, no data)\n")
    print("The position part of a layer's input is the mean over the 64 held-out crops of each token's "
          "LayerNorm'd input, its share the energy of that mean over the energy of the input.\n")
    print("| init | quantity | " + " | ".join(str(i) for i in range(12)) + " |\n|---|---|" + "---|" * 12)
    for label, cfg in (("the default (whole stream)", {}), ("position subspace (k = 48)",
                                                                  dict(position_subspace=True))):
        model = stock(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = initialize_model(model, "impulse", **cfg)
        x = crops(CHECK_PHOTO, 64, seed=1)
        hits = held_out_hits(model, report, x)
        share = position_share(model, x)
        print(f"| {label} | hit rate | " + " | ".join(f"{h:.2f}" for h in hits) + " |")
        print(f"| {label} | position share | " + " | ".join(f"{s:.2f}" for s in share) + " |", flush=True)
    print()


def models():
    print("## ViT-T/S/B at 224: today's default and the position subspace, without and with data\n")
    for name in ("vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"):
        if ONLY_MODEL not in (None, name):
            continue
        print(f"### `{name}`\n\n{header(12)}")
        for label, cfg in (("position subspace, no data", dict(position_subspace=True)),
                           ("position subspace, data", dict(position_subspace=True, data="data")),
                           ("whole stream, no data (the default)", dict())):
            hits, secs, report = run(name, **cfg)
            k = (report.get("position_subspace") or {}).get("dims")
            print(row(label + (f" (k = {k})" if k else ""), hits, secs), flush=True)
        print()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["hypotheses", "depth", "models", "small", "peers"])
    ap.add_argument("--rows", help="peers: run these rows only (comma-separated first words of their labels)")
    ap.add_argument("--model", help="run the model sections on this timm model only")
    args = ap.parse_args()
    ONLY_MODEL = args.model
    ONLY_ROWS = args.rows.split(",") if args.rows else None
    torch.set_num_threads(1)
    print("# Structure at 16x16 patches: held-out hit rate per layer\n")
    print("Command: `OMP_NUM_THREADS=1 python docs/results/patch16/structure.py` (init s: seconds of the "
          "init on one CPU thread, beside other jobs). Hit rate: share of grid query rows whose attention's "
          "argmax is the head's impulse offset, averaged over heads and the 64 held-out crops.\n")
    for part in ("hypotheses", "depth", "models", "small", "peers"):
        if args.only in (None, part):
            globals()[part]()
