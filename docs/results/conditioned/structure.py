"""Held-out structure at init of train runs: per layer, the share of queries whose strongest key is
the impulse offset's target (hit rate), on the first N test images, for the layers (and heads) whose
Q/K an impulse init wrote; a mixed init's lower part gives the offsets of its layers, and with
``split_head`` only its lower heads are counted.

    python docs/results/conditioned/structure.py RUN_FOLDER [RUN_FOLDER ...] --samples 256
    python docs/results/conditioned/structure.py RUN_FOLDER --init impulse -p base=model   # another init, same run

``--init``/``-p`` measure the run's model and seed with another init (a row whose runs have no folders).

Each run's model is rebuilt at init from its config.json exactly as ``structinit train`` built it
(:func:`structinit.training.run_models.run_model`, which also fits the impulse init to the run's
first training inputs when its ``data_fit`` asks for data); test images are never seen by that fit.
"""

import argparse
import math

import numpy as np


def lower_offsets(report):
    """``({layer: offsets [heads, 2]}, heads counted or None)`` of an init report."""
    part = report.get("lower") if report.get("method") == "mixed" else report
    rows = [r for r in (part or {}).get("layers", []) if "offsets" in r]
    split_layer = report.get("split_layer", math.inf)
    offsets = {int(r["layer"]): np.asarray(r["offsets"]) for r in rows if r["layer"] < split_layer}
    return offsets, report.get("split_head")


def main():
    from structinit.analysis.fidelity import attention_fidelity
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset
    from structinit.training.run_models import run_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--init", default=None)
    ap.add_argument("-p", dest="params", action="append", default=[])
    args = ap.parse_args()
    for path in args.runs:
        got = run_model(path, data_dir=args.data_dir)
        if args.init:
            from structinit.init.registry import parse_assignments
            from structinit.training.config import TrainConfig
            from structinit.training.run_models import preset_model

            flat = {**got.config.to_dict(), "init": args.init, "init_params": parse_assignments(args.params)}
            flat.pop("init_spelling", None)
            got = preset_model(TrainConfig.from_dict(flat))
        cfg = got.config
        data = load_dataset(cfg.dataset, args.data_dir or cfg.data_dir, image_size=cfg.image_size)
        x = normalize(data.test.images[:args.samples], data.info.mean, data.info.std)
        offsets, heads = lower_offsets(got.report or {})
        if not offsets:
            print(f"{path}: no impulse offsets in the init report")
            continue
        fid = attention_fidelity(got.model, x, offsets=offsets, filter=3)
        hit = np.asarray(fid.hit_rate)[:, :heads] if heads else np.asarray(fid.hit_rate)
        per_layer = [f"{np.nanmean(hit[i]):.2f}" if i in offsets else "-" for i in range(hit.shape[0])]
        print(f"{path}: {cfg.init.method} seed {cfg.seed}, hit rate per layer on {x.shape[0]} test images"
              f"{f' (heads 0-{heads - 1})' if heads else ''}: {' '.join(per_layer)}")


if __name__ == "__main__":
    main()
