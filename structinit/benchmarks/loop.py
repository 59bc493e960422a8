"""The training loop's overhead: :func:`run_loop_bench` measures the images per second of
``train``'s epoch loop (:func:`~structinit.training.loop.train_epoch`: its optimizer, gradient
clipping, learning-rate schedule and bookkeeping) against a bare PyTorch loop of the same model,
data, batch, optimizer, clipping and threads, alternating the two so that a drifting machine hits
both alike.

Example::

    loop = run_loop_bench("vit-digits", "digits")   # loop["ratio"]: train_epoch / bare, per repeat
    print(loop_bench_table(loop))
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional

from structinit.errors import UsageError, param
from structinit.runtime import synchronize


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

    def lr(step: int) -> float:
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
        synchronize(dev)
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

            def lr_in_epoch(s: int, first: int = e * steps) -> float:
                return lr(first + s)

            sums, _ = train_epoch(sc, batches, lr_in_epoch)
            seen += float(sums[2])
        synchronize(dev)
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


__all__ = ["run_loop_bench", "loop_bench_table"]
