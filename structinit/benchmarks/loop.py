"""The training loop's overhead: :func:`run_loop_bench` measures the images per second of
``train``'s epoch loop (:func:`~structinit.training.loop.train_epoch`: its optimizer, gradient
clipping, learning-rate schedule and bookkeeping) against a bare PyTorch loop of the same model,
data, batch, optimizer, clipping, precision and threads, alternating the two so that a drifting
machine hits both alike. With ``timm_model`` the same bare loop also trains timm's own model of
that name (built by ``timm.create_model`` at the data's size and the preset's patch, without a
class token, average-pooled), a third loop in each repeat: ``train``'s loop on structinit's model
against a bare loop on the model a timm user would build.

The data: an in-memory dataset, or (``dataset=None``) Gaussian noise images with random labels of
10 classes (the images/s of a loop do not depend on what the images show; ViT-T at 32x32 without
CIFAR-10's files: ``image_size=32, in_chans=3``).

Example::

    loop = run_loop_bench("vit-digits", "digits")   # loop["ratio"]: train_epoch / bare, per repeat
    print(loop_bench_table(loop))
    run_loop_bench("vit-t", None, batch_size=128, amp="bf16", device="cuda", timm_model="vit_tiny_patch16_224")
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from structinit.errors import UsageError, param
from structinit.runtime import device_name, synchronize

#: The noise images the benchmarks run on without a dataset: how many (an epoch), their side and channels
#: (CIFAR-10's shape; ``bench fit`` and ``bench loop`` alike).
NOISE_IMAGES, NOISE_IMAGE_SIZE, NOISE_IN_CHANS = 10_000, 32, 3

def _noise_data(images: int, image_size: int, in_chans: int, seed: int):
    """``(x, y, info)``: ``images`` Gaussian noise images ``[images, in_chans, image_size, image_size]``,
    labels drawn from 10 classes, and a :class:`~structinit.training.datasets.DatasetInfo` saying so
    (patch 2, no normalization: the noise is the normalized input's statistics already)."""
    import torch

    from structinit.training.datasets import DatasetInfo

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(images, in_chans, image_size, image_size, generator=gen)
    y = torch.randint(0, 10, (images,), generator=gen)
    info = DatasetInfo("noise", 10, image_size, in_chans, (0.0,) * in_chans, (1.0,) * in_chans, 2, False, "none")
    return x, y, info


@dataclass
class _Recipe:
    """What both loops share: the data (on ``dev``), batch, epochs, seed, ``train``'s hyperparameters
    ``hp`` (optimizer, clipping, schedule), the autocast ``dtype`` (``None``: full precision) and
    ``norm`` (``(mean, std)`` applied to each batch, as ``train`` does; ``None``: the inputs as they are)."""

    x: Any
    y: Any
    batch_size: int
    epochs: int
    seed: int
    dev: str
    hp: Dict[str, Any]
    dtype: Any
    norm: Optional[Tuple[Sequence[float], Sequence[float]]]

    @property
    def steps(self) -> int:
        return self.x.shape[0] // self.batch_size

    def lr(self, step: int) -> float:
        from structinit.training.loop import lr_at

        hp = self.hp
        return lr_at(step, self.steps * self.epochs, int(hp["warmup_epochs"] * self.steps), hp["lr"], hp["min_lr"])

    def autocast(self):
        import torch

        return torch.autocast(torch.device(self.dev).type, dtype=self.dtype, enabled=self.dtype is not None)

    def batches(self, epoch: int):
        """``(inputs, labels)`` of each batch of ``epoch``, in ``train``'s order, normalized as it does."""
        from structinit.training.augment import normalize
        from structinit.training.loop import shard_batches

        for idx in shard_batches(self.x.shape[0], self.batch_size, 0, 1, self.seed, epoch):
            idx = idx.to(self.dev)
            x = self.x[idx]
            yield (x if self.norm is None else normalize(x, *self.norm)), self.y[idx]

    def bare(self, model) -> float:
        """Images/s of a bare PyTorch loop of the recipe training ``model``."""
        import torch

        from structinit.training.loop import build_optimizer

        opt, trainable = build_optimizer(model, self.hp)
        crit = torch.nn.CrossEntropyLoss()
        model.train()
        t0, step = time.perf_counter(), 0
        for e in range(self.epochs):
            for x, y in self.batches(e):
                for group in opt.param_groups:
                    group["lr"] = self.lr(step)
                with self.autocast():
                    loss = crit(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, self.hp["grad_clip"])
                opt.step()
                step += 1
        synchronize(self.dev)
        return step * self.batch_size / (time.perf_counter() - t0)

    def train_loop(self, model) -> float:
        """Images/s of ``train``'s epoch loop (:func:`~structinit.training.loop.train_epoch`) training ``model``."""
        import torch

        from structinit.training.loop import StepContext, build_optimizer, train_epoch

        opt, trainable = build_optimizer(model, self.hp)
        sc = StepContext(net=model, opt=opt, trainable=trainable, criterion=torch.nn.CrossEntropyLoss(),
                         autocast=self.autocast, grad_clip=float(self.hp["grad_clip"]))
        t0, seen = time.perf_counter(), 0.0
        for e in range(self.epochs):
            def lr_in_epoch(s: int, first: int = e * self.steps) -> float:
                return self.lr(first + s)

            sums, _ = train_epoch(sc, self.batches(e), lr_in_epoch)
            seen += float(sums[2])
        synchronize(self.dev)
        return seen / (time.perf_counter() - t0)


def timm_vit(name: str, *, num_classes: int, image_size: int, in_chans: int, patch: int, seed: int = 0):
    """timm's model ``name`` (untrained, seeded) for images ``[B, in_chans, image_size, image_size]`` at
    patch ``patch``, without a class token and average-pooled, as a timm user builds the paper's ViT
    (timm's own learned position embedding kept). A name timm does not know, or a model that does not
    take those settings (not a VisionTransformer), is a :class:`UsageError`."""
    import timm
    import torch

    if not timm.is_model(name):
        raise UsageError(f"unknown {param('timm_model')} {name!r}: not a timm model name (timm.list_models('vit*') "
                         "lists the ViTs)")
    torch.manual_seed(seed)
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=image_size,
                                 patch_size=patch, in_chans=in_chans, class_token=False, global_pool="avg")
    except (TypeError, ValueError, AssertionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{param('timm_model')} {name}: timm cannot build it at {image_size}x{image_size}, patch "
                         f"{patch}, without a class token, average-pooled ({first}); name a timm VisionTransformer "
                         "such as vit_tiny_patch16_224") from None


def _check_loop_bench(dataset: Optional[str], amp: str, timm_model: Optional[str], **counts: Optional[int]) -> None:
    """Refuse :func:`run_loop_bench`'s bad settings (a :class:`UsageError` naming the parameter) before
    any data is read; ``counts``: the settings that must be at least 1 where given."""
    from structinit.training.config import AMP_MODES
    from structinit.training.datasets import dataset_info

    for name, value in counts.items():
        if value is not None and value < 1:
            raise UsageError(f"{param(name)} must be at least 1, got {value}")
    if amp not in AMP_MODES:
        raise UsageError(f"unknown {param('amp')} {amp!r}; choose one of {', '.join(AMP_MODES)}")
    if dataset is None:
        return
    if any(counts[k] is not None for k in ("image_size", "in_chans", "images")):
        raise UsageError(f"{param('image_size')}, {param('in_chans')} and {param('images')} shape the noise "
                         f"images; {param('dataset')} {dataset} has its own")
    info = dataset_info(dataset)
    if not info.in_memory:
        raise UsageError(f"{param('dataset')} {dataset}: the loop benchmark takes an in-memory dataset")
    if timm_model is not None and info.is_sequence:
        raise UsageError(f"{param('timm_model')} trains timm's image model; {param('dataset')} {dataset} is a "
                         "sequence dataset")


def _alternate(loops: Dict[str, Callable[[], float]], repeats: int, say: Callable[[str], None]) -> Dict[str, Any]:
    """Run each of ``loops`` (images/s; ``bare`` and ``train_epoch`` first) once a repeat, in turn,
    ``repeats`` times: ``{name: [images/s per repeat]}``, ``ratio`` (train_epoch / bare of each
    repeat), ``timm_ratio`` (train_epoch / timm_bare) where a ``timm_bare`` loop runs, and the
    median of each list as ``NAME_median``."""
    out: Dict[str, Any] = {name: [] for name in loops}
    for r in range(repeats):
        say(f"repeat {r + 1}/{repeats}")
        for name, loop in loops.items():
            out[name].append(loop())
    out["ratio"] = [o / b for o, b in zip(out["train_epoch"], out["bare"])]
    if "timm_bare" in out:
        out["timm_ratio"] = [o / t for o, t in zip(out["train_epoch"], out["timm_bare"])]
    out.update({f"{name}_median": statistics.median(values) for name, values in list(out.items())})
    return out


def run_loop_bench(preset: str = "vit-digits", dataset: Optional[str] = "digits", *, batch_size: int = 64,
                   epochs: int = 2, repeats: int = 3, seed: int = 0, device: str = "cpu", amp: str = "auto",
                   data_dir=None, image_size: Optional[int] = None, in_chans: Optional[int] = None,
                   images: Optional[int] = None, timm_model: Optional[str] = None,
                   progress: Optional[Callable[[str], None]] = None) -> Dict:
    """Images per second of ``train``'s epoch loop and of a bare loop (see the module docstring),
    ``repeats`` times each, alternating, ``epochs`` epochs a time, on ``device`` with ``train``'s
    mixed precision (``amp``: auto is bf16 on a GPU; off, bf16, fp16) in both; ``data_dir``: where the
    dataset's files are (datasets read from disk). ``dataset=None``: noise images, ``images`` of them
    (default 10,000) of side ``image_size`` (32) with ``in_chans`` channels (3). ``timm_model``: a
    third loop, the bare one on timm's model of that name (see :func:`timm_vit`).

    Returns ``{"bare", "train_epoch", "ratio"}`` (lists, one per repeat; ``ratio`` = train_epoch /
    bare of that repeat) and the medians; with ``timm_model`` also ``timm_bare`` and ``timm_ratio``
    (train_epoch / timm_bare of each repeat) and theirs."""
    import torch

    from structinit.runtime import resolve_device
    from structinit.training.config import TrainConfig
    from structinit.training.datasets import dataset_info, load_dataset
    from structinit.training.loop import amp_dtype, amp_name
    from structinit.training.models import ModelConfig, build_model

    _check_loop_bench(dataset, amp, timm_model, batch_size=batch_size, epochs=epochs, repeats=repeats,
                      image_size=image_size, in_chans=in_chans, images=images)
    say = progress or (lambda message: None)
    dev = resolve_device(device)
    dtype = amp_dtype(amp, dev)

    if dataset is None:
        x_cpu, y_cpu, info = _noise_data(images or NOISE_IMAGES, image_size or NOISE_IMAGE_SIZE,
                                         in_chans or NOISE_IN_CHANS, seed)
        data_name = f"noise [{x_cpu.shape[0]}, {info.in_chans}, {info.image_size}, {info.image_size}]"
    else:
        info, data = dataset_info(dataset), load_dataset(dataset, data_dir)
        x_cpu, y_cpu, data_name = data.train.images, data.train.labels, dataset
    n = x_cpu.shape[0]
    if batch_size > n:
        raise UsageError(f"{param('batch_size')} {batch_size} is larger than the {n} training images of {data_name}")
    # noise images train with the library's defaults (those of a dataset without its own, such as cifar10)
    hp = TrainConfig(model=preset, dataset=dataset or "cifar10", batch_size=batch_size).hparams()
    recipe = _Recipe(x_cpu.to(dev), y_cpu.to(dev), batch_size, epochs, seed, dev, hp, dtype,
                     None if info.is_sequence or dataset is None else (info.mean, info.std))

    def fresh():
        return build_model(ModelConfig(preset), num_classes=info.num_classes, image_size=info.image_size,
                           in_chans=info.in_chans, default_patch=info.default_patch, seed=seed).to(dev)

    def timm_fresh():
        assert timm_model is not None
        patch = ModelConfig(preset).resolved(info.default_patch).get("patch", info.default_patch)
        return timm_vit(timm_model, num_classes=info.num_classes, image_size=info.image_size,
                        in_chans=info.in_chans, patch=patch, seed=seed).to(dev)

    out: Dict[str, Any] = {"preset": preset, "dataset": data_name, "batch_size": batch_size, "epochs": epochs,
                           "images": n, "threads": torch.get_num_threads(),
                           "amp": amp_name(dtype),
                           "device": device_name(dev)}
    loops = {"bare": lambda: recipe.bare(fresh()), "train_epoch": lambda: recipe.train_loop(fresh())}
    if timm_model is not None:
        timm_fresh()  # a name timm cannot build is refused before any loop runs
        out["timm_model"] = timm_model
        loops["timm_bare"] = lambda: recipe.bare(timm_fresh())
    out.update(_alternate(loops, repeats, say))
    return out


def loop_bench_table(r: Dict[str, Any]) -> str:
    """Plain-text lines of :func:`run_loop_bench`'s result."""
    per = ", ".join(f"{x:.3f}" for x in r["ratio"])
    lines = [
        f"{r['preset']} on {r['dataset']}, batch {r['batch_size']}, {r['epochs']} epochs a repeat, {r['threads']} "
        f"thread(s), {r['device']}, amp {r['amp']}",
        f"bare loop:      {r['bare_median']:8.1f} images/s (median of {len(r['bare'])})",
        f"train's loop:   {r['train_epoch_median']:8.1f} images/s",
        f"train / bare:   {r['ratio_median']:.3f} (median; per repeat {per})"]
    if "timm_bare" in r:
        per = ", ".join(f"{x:.3f}" for x in r["timm_ratio"])
        lines += [f"bare loop, timm's {r['timm_model']}: {r['timm_bare_median']:8.1f} images/s",
                  f"train / timm's bare: {r['timm_ratio_median']:.3f} (median; per repeat {per})"]
    return "\n".join(lines)


__all__ = ["run_loop_bench", "loop_bench_table"]
