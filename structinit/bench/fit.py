"""Benchmarks of the default init's cost and of the training loop's overhead.

:func:`run_fit_bench` times the impulse data fit (each version asked for) on one model preset
against the time of training steps of the same model at batch 64, the unit the fit's cost is
judged in: a fit worth 100 training steps costs what 100 steps of the run cost. The inputs are the
dataset's first training images when one is named (normalized as ``train`` does), else Gaussian
noise images of the preset's input shape (the fit's cost does not depend on what the images show;
its hit rate does, so it is reported only for real inputs).

:func:`run_loop_bench` measures the images per second of ``train``'s epoch loop
(:func:`~structinit.training.loop.train_epoch`: its optimizer, gradient clipping, learning-rate
schedule and bookkeeping) against a bare PyTorch loop of the same model, data, batch, optimizer,
clipping and threads, alternating the two so that a drifting machine hits both alike.

Example::

    result = run_fit_bench("vit-digits", dataset="digits", versions=(1, 2))
    print(fit_bench_table(result))
    loop = run_loop_bench("vit-digits", "digits")   # loop["ratio"]: train_epoch / bare, per repeat
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional, Sequence

from structinit.errors import UsageError, param


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


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


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
        _sync(xb.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_fit_bench(preset: str = "vit-digits", *, dataset: Optional[str] = None, image_size: int = 32,
                  in_chans: int = 3, versions: Sequence[int] = (2,), samples: int = 256, train_steps: int = 10,
                  steps: int = 300, seed: int = 0, cache_dir=None, device: str = "cpu",
                  progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Time the impulse init with its data fit (each of ``versions``) on ``preset`` (see the module
    docstring), its plain solve cached first, on a fresh model each time; and ``train_steps``
    training steps of the model at batch 64. Returns ``{"shape", "train_step_seconds", "rows"}``;
    each row: ``version``, ``seconds`` (the whole init), ``fit_seconds`` (the fit itself),
    ``train_steps`` (``seconds`` in training steps), ``hit_rate``/``min_layer_hit_rate`` on the batch
    (real inputs only), ``step_images``. ``steps``: the fit's Adam steps (300, the default; fewer to
    time a slow version's steps and scale). ``device``: where the model, the inputs and so the fit are."""
    import tempfile

    import torch

    from structinit.fit.settings import FIT_VERSIONS
    from structinit.init.specs import initialize_model

    bad = [v for v in versions if v not in FIT_VERSIONS]
    if bad or not versions:
        raise UsageError(f"{param('versions')} must be among {', '.join(map(str, FIT_VERSIONS))}, got "
                         f"{', '.join(map(str, versions)) or '(none)'}")
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
            _sync(dev)
            t0 = time.perf_counter()
            rep = initialize_model(fresh, "impulse", seed=seed, data=x, data_fit_version=v, cache_dir=cache,
                                   data_fit_samples=samples, data_fit=steps)
            _sync(dev)
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


def run_loop_bench(preset: str = "vit-digits", dataset: str = "digits", *, batch_size: int = 64, epochs: int = 2,
                   repeats: int = 3, seed: int = 0, device: str = "cpu", amp: str = "auto", data_dir=None,
                   progress: Optional[Callable[[str], None]] = None) -> Dict:
    """Images per second of ``train``'s epoch loop and of a bare loop (see the module docstring),
    ``repeats`` times each, alternating, ``epochs`` epochs a time, on ``device`` with ``train``'s
    mixed precision (``amp``: auto is bf16 on a GPU) in both; ``data_dir``: where the dataset's files
    are (datasets read from disk). Returns ``{"bare", "train_epoch",
    "ratio"}`` (lists, one per repeat; ``ratio`` = train_epoch / bare of that repeat) and the medians."""
    import torch

    from structinit.runtime import resolve_device
    from structinit.training.augment import normalize
    from structinit.training.config import TrainConfig
    from structinit.training.datasets import dataset_info, load_dataset
    from structinit.training.loop import StepContext, amp_dtype, build_optimizer, lr_at, shard_batches, train_epoch
    from structinit.training.models import ModelConfig, build_model

    info = dataset_info(dataset)
    if not info.in_memory:
        raise UsageError(f"{param('dataset')} {dataset}: the loop benchmark takes an in-memory dataset")
    for name, value in (("batch_size", batch_size), ("epochs", epochs), ("repeats", repeats)):
        if value < 1:
            raise UsageError(f"{param(name)} must be at least 1, got {value}")
    say = progress or (lambda message: None)
    dev = resolve_device(device)
    dtype = amp_dtype(amp, dev)

    def autocast():
        return torch.autocast(torch.device(dev).type, dtype=dtype, enabled=dtype is not None)

    data = load_dataset(dataset, data_dir)
    x_all, y_all = data.train.images.to(dev), data.train.labels.to(dev)
    n = len(data.train)
    if batch_size > n:
        raise UsageError(f"{param('batch_size')} {batch_size} is larger than the {n} training images of {dataset}")
    hp = TrainConfig(model=preset, dataset=dataset, batch_size=batch_size).hparams()
    steps = n // batch_size
    total = steps * epochs

    def prepare(x):
        return x if info.is_sequence else normalize(x, info.mean, info.std)

    def fresh():
        return build_model(ModelConfig(preset), num_classes=info.num_classes, image_size=info.image_size,
                           in_chans=info.in_chans, default_patch=info.default_patch, seed=seed).to(dev)

    def lr(step):
        return lr_at(step, total, int(hp["warmup_epochs"] * steps), hp["lr"], hp["min_lr"])

    def bare() -> float:
        model = fresh()
        opt, trainable = build_optimizer(model, hp)
        crit = torch.nn.CrossEntropyLoss()
        model.train()
        t0, step = time.perf_counter(), 0
        for e in range(epochs):
            for idx in shard_batches(n, batch_size, 0, 1, seed, e):
                for group in opt.param_groups:
                    group["lr"] = lr(step)
                idx = idx.to(dev)
                with autocast():
                    loss = crit(model(prepare(x_all[idx])).float(), y_all[idx])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, hp["grad_clip"])
                opt.step()
                step += 1
        _sync(dev)
        return total * batch_size / (time.perf_counter() - t0)

    def ours() -> float:
        model = fresh()
        opt, trainable = build_optimizer(model, hp)
        sc = StepContext(net=model, opt=opt, trainable=trainable, criterion=torch.nn.CrossEntropyLoss(),
                         autocast=autocast, grad_clip=float(hp["grad_clip"]))
        t0, seen = time.perf_counter(), 0.0
        for e in range(epochs):
            batches = ((prepare(x_all[i]), y_all[i]) for i in
                       (idx.to(dev) for idx in shard_batches(n, batch_size, 0, 1, seed, e)))
            sums, _ = train_epoch(sc, batches, lambda s, first=e * steps: lr(first + s))
            seen += float(sums[2])
        _sync(dev)
        return seen / (time.perf_counter() - t0)

    out: Dict[str, Any] = {"preset": preset, "dataset": dataset, "batch_size": batch_size, "epochs": epochs,
                           "threads": torch.get_num_threads(),
                           "amp": str(dtype).replace("torch.", "") if dtype else "off",
                           "device": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu",
                           "bare": [], "train_epoch": [], "ratio": []}
    for r in range(repeats):
        say(f"repeat {r + 1}/{repeats}")
        b, o = bare(), ours()
        out["bare"].append(b)
        out["train_epoch"].append(o)
        out["ratio"].append(o / b)
    for name in ("bare", "train_epoch", "ratio"):
        out[f"{name}_median"] = statistics.median(out[name])
    return out


def loop_bench_table(r: Dict[str, Any]) -> str:
    """Plain-text lines of :func:`run_loop_bench`'s result."""
    per = ", ".join(f"{x:.3f}" for x in r["ratio"])
    return "\n".join([
        f"{r['preset']} on {r['dataset']}, batch {r['batch_size']}, {r['epochs']} epochs a repeat, {r['threads']} "
        f"thread(s), {r['device']}, amp {r['amp']}",
        f"bare loop:      {r['bare_median']:8.1f} images/s (median of {len(r['bare'])})",
        f"train's loop:   {r['train_epoch_median']:8.1f} images/s",
        f"train / bare:   {r['ratio_median']:.3f} (median; per repeat {per})"])


__all__ = ["run_fit_bench", "fit_bench_table", "run_loop_bench", "loop_bench_table", "train_step_seconds"]
