"""The default init's cost: :func:`run_fit_bench` times the impulse data fit (each version asked
for) on one model preset against the time of training steps of the same model at batch 64, the unit
the fit's cost is judged in: a fit worth 100 training steps costs what 100 steps of the run cost.
The inputs are the dataset's first training images when one is named (normalized as ``train``
does), else Gaussian noise images of the preset's input shape (the fit's cost does not depend on
what the images show; its hit rate does, so it is reported only for real inputs).

Example::

    result = run_fit_bench("vit-digits", dataset="digits", versions=(1, 2))
    print(fit_bench_table(result))
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional, Sequence

from structinit.errors import UsageError, param
from structinit.runtime import synchronize


def _model_and_inputs(preset: str, dataset: Optional[str], image_size: int, in_chans: int, samples: int,
                      seed: int):
    """The preset's model (seeded) and ``samples`` inputs: the dataset's first training images as
    ``train`` normalizes them, or Gaussian noise images ``[samples, in_chans, image_size, image_size]``."""
    import torch

    from structinit.training.augment import normalize
    from structinit.training.datasets import dataset_info, load_dataset
    from structinit.training.models import ModelConfig, build_model

    if dataset is not None:
        info = dataset_info(dataset)
        if not info.in_memory or info.is_sequence:
            raise UsageError(f"{param('dataset')} {dataset}: the fit benchmark takes an in-memory image dataset")
        data = load_dataset(dataset)
        x = normalize(data.train.images[:samples], info.mean, info.std)
        image_size, in_chans, classes, patch = info.image_size, info.in_chans, info.num_classes, info.default_patch
    else:
        x = torch.randn(samples, in_chans, image_size, image_size, generator=torch.Generator().manual_seed(seed))
        classes, patch = 10, 2
    model = build_model(ModelConfig(preset), num_classes=classes, image_size=image_size, in_chans=in_chans,
                        default_patch=patch, seed=seed)
    return model, x


def train_step_seconds(model, x, steps: int, batch: int = 64) -> float:
    """Seconds per AdamW step (forward, backward, update) of ``model`` on batches of ``batch`` of
    ``x`` (on the model's device), the median over ``steps`` steps after two warm-up steps."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    xb = x[:batch] if x.shape[0] >= batch else x.repeat((batch + x.shape[0] - 1) // x.shape[0], 1, 1, 1)[:batch]
    y = torch.zeros(xb.shape[0], dtype=torch.long, device=xb.device)
    times = []
    model.train()
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(xb), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        synchronize(xb.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_fit_bench(preset: str = "vit-digits", *, dataset: Optional[str] = None, image_size: int = 32,
                  in_chans: int = 3, versions: Sequence[int] = (2,), samples: int = 256, train_steps: int = 10,
                  steps: int = 300, seed: int = 0, cache_dir=None, device: str = "cpu",
                  progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Time the impulse init with its data fit (each of ``versions``, distinct) on ``preset`` (see the module
    docstring), its plain solve cached first, on a fresh model each time; and ``train_steps``
    training steps of the model at batch 64. Returns ``{"shape", "train_step_seconds", "rows"}``;
    each row: ``version``, ``seconds`` (the whole init), ``fit_seconds`` (the fit itself),
    ``train_steps`` (``seconds`` in training steps), ``hit_rate``/``min_layer_hit_rate`` on the batch
    (real inputs only), ``step_images``. ``steps``: the fit's Adam steps (300, the default; fewer to
    time a slow version's steps and scale). ``device``: where the model, the inputs and so the fit are."""
    import tempfile

    import torch

    from structinit.fit.settings import FIT_VERSIONS
    from structinit.init.initialize import initialize_model

    bad = [v for v in versions if v not in FIT_VERSIONS]
    if bad or not versions:
        raise UsageError(f"{param('versions')} must be among {', '.join(map(str, FIT_VERSIONS))}, got "
                         f"{', '.join(map(str, versions)) or '(none)'}")
    repeated = sorted({v for v in versions if list(versions).count(v) > 1})
    if repeated:  # each version is one row: a repeat would time the same fit twice, as a second row
        raise UsageError(f"{param('versions')} names version {', '.join(map(str, repeated))} more than once; each "
                         "version is timed once")
    from structinit.runtime import resolve_device

    dev = resolve_device(device)
    say = progress or (lambda message: None)
    model, x = _model_and_inputs(preset, dataset, image_size, in_chans, samples, seed)
    arch = model.structinit_arch
    model, x = model.to(dev), x.to(dev)
    with tempfile.TemporaryDirectory() as scratch:
        cache = cache_dir or scratch
        say("solving the plain artifact (cached, not timed)")
        initialize_model(model, "impulse", seed=seed, data_fit=0, cache_dir=cache)
        say(f"timing {train_steps} training steps at batch 64")
        step = train_step_seconds(model, x, train_steps)
        rows = []
        for v in versions:
            fresh, _ = _model_and_inputs(preset, dataset, image_size, in_chans, 1, seed)
            fresh = fresh.to(dev)
            say(f"data fit version {v}")
            synchronize(dev)
            t0 = time.perf_counter()
            rep = initialize_model(fresh, "impulse", seed=seed, data=x, data_fit_version=v, cache_dir=cache,
                                   data_fit_samples=samples, data_fit=steps)
            synchronize(dev)
            total = time.perf_counter() - t0
            fit = rep["data_fit"]
            row = {"version": v, "steps": steps, "seconds": total, "fit_seconds": fit.get("seconds"),
                   "train_steps": total / step, "step_images": fit.get("step_images"), "samples": fit.get("samples")}
            if dataset is not None:
                hits = [r["hit_rate"] for r in fit["layers"]]
                row.update(hit_rate=sum(hits) / len(hits), min_layer_hit_rate=min(hits))
            rows.append(row)
    inputs = dataset or f"noise [{samples}, {in_chans}, {image_size}, {image_size}]"
    where = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu"
    return {"shape": {"preset": preset, "grid": arch["grid"], "dim": arch["dim"], "heads": arch["heads"],
                      "depth": arch["depth"], "inputs": inputs, "threads": torch.get_num_threads(), "device": where},
            "train_step_seconds": step, "rows": rows}


def fit_bench_table(result: Dict[str, Any]) -> str:
    """Plain-text table of :func:`run_fit_bench`'s result."""
    s = result["shape"]
    lines = [f"{s['preset']}: grid {'x'.join(map(str, s['grid']))}, dim {s['dim']}, {s['heads']} heads, depth "
             f"{s['depth']}; inputs {s['inputs']}; {s['threads']} thread(s); {s['device']}",
             f"one training step at batch 64: {result['train_step_seconds']:.3f} s",
             f"{'version':>7} {'steps':>5} {'init s':>8} {'fit s':>8} {'= steps':>8} {'imgs/step':>9} {'hit':>6} "
             f"{'min hit':>8}"]
    for r in result["rows"]:
        hit = f"{r['hit_rate']:>6.3f} {r['min_layer_hit_rate']:>8.3f}" if "hit_rate" in r else f"{'-':>6} {'-':>8}"
        lines.append(f"{r['version']:>7} {r['steps']:>5} {r['seconds']:>8.2f} {r['fit_seconds']:>8.2f} "
                     f"{r['train_steps']:>8.1f} {str(r['step_images'] or 'all'):>9} {hit}")
    return "\n".join(lines)


__all__ = ["run_fit_bench", "fit_bench_table", "train_step_seconds"]
