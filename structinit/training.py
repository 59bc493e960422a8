"""``train()``: the paper's training setup (SPEC 5) on one CPU, one GPU, or many under torchrun.

Example::

    from structinit.training import TrainConfig, train
    result = train(TrainConfig(model="vit-digits", dataset="digits", init="impulse", epochs=40, out="runs/d"))
    result.best_acc, result.last_acc  # test accuracy in %

Defaults are the paper's recipe (AdamW lr 1e-3, weight decay 0.01, batch 512, 200 epochs, cosine
to 1e-6 after 10 warm-up epochs, eps 1e-3, grad clip 3.0, RandAugment, mixed precision on GPU),
adjusted per dataset and model family (:data:`DATASET_RECIPES`, :data:`MODEL_RECIPES`); every
field left ``None`` takes that default and every one can be set.

A run directory (``out``) holds ``config.json`` (settings as given and as resolved),
``metrics.jsonl`` (one line per finished epoch), ``checkpoint.pt`` (everything to resume, written
atomically after every epoch, in timm's ``{'state_dict', 'epoch', 'arch', 'args'}`` layout),
``best.pt`` (weights of the best epoch) and, at the end, ``final.json``. ``resume=True`` continues
from ``checkpoint.pt``: the checkpoint is the source of truth, ``metrics.jsonl`` is rewritten from
it, and data order and randomness are restored, so no epoch is repeated or skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .atomic import atomic_write
from .errors import StructinitError, UsageError

CHECKPOINT_FORMAT = "structinit-train/1"

#: SPEC 5: the paper's recipe (and released README) for CIFAR-sized data.
RECIPE: Dict[str, Any] = dict(epochs=200, batch_size=512, lr=1e-3, min_lr=1e-6, weight_decay=0.01, warmup_epochs=10,
                              opt_eps=1e-3, grad_clip=3.0, label_smoothing=0.0, randaug_n=2, randaug_m=9)
#: Per-dataset changes to :data:`RECIPE`. digits (the SPEC 5 CPU grid): 1437 images want small
#: batches, and with only ~900 steps Adam's eps 1e-3 damps the small early gradients so much that
#: the loss sits at ln(10) for epochs; eps 1e-8 trains.
DATASET_RECIPES: Dict[str, Dict[str, Any]] = {
    "digits": dict(epochs=40, batch_size=64, warmup_epochs=2, opt_eps=1e-8),
    "synthetic": dict(epochs=10, batch_size=64, warmup_epochs=1, opt_eps=1e-8),
    "imagefolder": dict(epochs=300, batch_size=256, weight_decay=0.05, warmup_epochs=20),
}
#: Per-model-family changes (Table 4: ConvMixer at lr 0.01 for 100 epochs).
MODEL_RECIPES: Dict[str, Dict[str, Any]] = {"convmixer": dict(lr=0.01, epochs=100)}

AMP_MODES = ("auto", "bf16", "fp16", "off")
# Settings that may differ when a run is resumed (they do not change what is computed).
RESUME_FREE = ("out", "resume", "device", "workers", "threads", "compile", "data_dir", "download", "amp",
               "eval_batch_size")


@dataclass
class TrainConfig:
    """Everything a training run depends on. ``None`` means the recipe default (see module doc).

    Model: ``model`` (a preset of :mod:`structinit.models`) and its overrides ``dim``, ``heads``,
    ``depth``, ``patch``, ``mlp_ratio``, ``pool``, ``pos_embed``, ``kernel``, ``filters``,
    ``drop_path``. Init: ``init`` (a method of :mod:`structinit.init_methods`; ``None``: the
    model's own init, timm's trunc normal for ViTs) with ``init_params``. Data: ``dataset``,
    ``data_dir``, ``download``, ``image_size`` (imagefolder), ``augment`` (``randaugment``,
    ``crop-flip``, ``flip``, ``none``). ``batch_size`` is the global batch (split over processes).
    ``threads``: torch CPU threads of each process (``None``: torch's default; on a loaded machine
    1 can be several times faster than oversubscribed threads).
    """

    model: str = "vit-digits"
    dataset: str = "digits"
    out: Optional[str] = None
    resume: bool = False
    # model
    dim: Optional[int] = None
    heads: Optional[int] = None
    depth: Optional[int] = None
    patch: Optional[int] = None
    mlp_ratio: Optional[float] = None
    pool: Optional[str] = None
    pos_embed: Optional[str] = None
    kernel: Optional[int] = None
    filters: str = "trained"
    drop_path: float = 0.0
    # init
    init: Optional[str] = None
    init_params: Dict[str, Any] = field(default_factory=dict)
    # data
    data_dir: Optional[str] = None
    download: bool = False
    image_size: Optional[int] = None
    augment: Optional[str] = None
    # recipe
    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup_epochs: Optional[float] = None
    opt_eps: Optional[float] = None
    grad_clip: Optional[float] = None
    label_smoothing: Optional[float] = None
    randaug_n: Optional[int] = None
    randaug_m: Optional[int] = None
    # execution
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    compile: bool = False
    workers: int = 4
    threads: Optional[int] = None
    eval_batch_size: Optional[int] = None

    def model_config(self):
        """The :class:`~structinit.models.ModelConfig` these (flat, CLI-shaped) fields describe."""
        from .models import ModelConfig

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig) if f.name != "name"}
        return ModelConfig(name=self.model, **fields)

    def recipe(self) -> Dict[str, Any]:
        """The resolved recipe: :data:`RECIPE` < dataset < model family < the fields set here."""
        from .datasets import dataset_info

        info = dataset_info(self.dataset)
        out = dict(RECIPE)
        out.update(DATASET_RECIPES.get(self.dataset, {}))
        out.update(MODEL_RECIPES.get(self.model_config().family, {}))
        for key in RECIPE:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["augment"] = self.augment or info.augment
        _check_recipe(out)
        return out

    def validate(self) -> Dict[str, Any]:
        """Check every setting that can be checked without torch or data; return :meth:`recipe`."""
        recipe = self.recipe()
        family = self.model_config().family
        if self.init is None and self.init_params:
            raise UsageError("--init-param needs --init")
        if self.init is not None and family != "vit":
            raise UsageError(f"--init applies to the ViT presets; {self.model} keeps its own init")
        if self.workers < 0:
            raise UsageError(f"--workers must not be negative, got {self.workers}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {self.threads}")
        if self.resume and not self.out:
            raise UsageError("--resume needs --out DIR")
        return recipe

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UsageError(f"unknown training setting(s) {unknown}")
        return cls(**d)


def _check_recipe(r: Dict[str, Any]) -> None:
    from .augment import AUGMENTS

    for key in ("epochs", "batch_size"):
        if int(r[key]) < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be at least 1, got {r[key]}")
    for key in ("lr", "opt_eps"):
        if not r[key] > 0:
            raise UsageError(f"--{key.replace('_', '-')} must be positive, got {r[key]}")
    for key in ("min_lr", "weight_decay", "warmup_epochs", "grad_clip", "randaug_n", "randaug_m"):
        if r[key] < 0:
            raise UsageError(f"--{key.replace('_', '-')} must not be negative, got {r[key]}")
    if r["min_lr"] > r["lr"]:
        raise UsageError(f"--min-lr {r['min_lr']} is above --lr {r['lr']}")
    if not 0 <= r["label_smoothing"] < 1:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {r['label_smoothing']}")
    if r["augment"] not in AUGMENTS:
        raise UsageError(f"unknown --augment {r['augment']!r}; choose one of {', '.join(AUGMENTS)}")


@dataclass
class TrainResult:
    """What :func:`train` returns (and writes as ``final.json``). Accuracies in %."""

    best_acc: float
    best_epoch: int
    last_acc: float
    epochs: int
    wall_seconds: float
    params: Dict[str, int]
    metrics: List[Dict[str, Any]]
    out: Optional[str] = None
    resumed_from: Optional[int] = None
    world_size: int = 1
    device: str = "cpu"
    init_report: Optional[Dict[str, Any]] = None

    def summary(self) -> Dict[str, Any]:
        """The ``final.json`` content (no per-epoch metrics, no init report)."""
        return {"best_acc": self.best_acc, "best_epoch": self.best_epoch, "last_acc": self.last_acc,
                "epochs": self.epochs, "wall_seconds": round(self.wall_seconds, 3), "params": self.params,
                "out": self.out, "resumed_from": self.resumed_from, "world_size": self.world_size,
                "device": self.device,
                "last": self.metrics[-1] if self.metrics else None}


def lr_at(step: int, total_steps: int, warmup_steps: int, lr: float, min_lr: float) -> float:
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    t = min((step - warmup_steps) / span, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def epoch_permutation(n: int, seed: int, epoch: int):
    """The training order of ``epoch`` (0-based): a permutation of ``n`` from ``(seed, epoch)`` alone,
    identical on every process and after a resume."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def shard_batches(n: int, global_batch: int, rank: int, world: int, seed: int, epoch: int):
    """This process's index batches ``[global_batch // world]`` of ``epoch`` (drop-last): step ``s``
    of every process together covers ``perm[s * B:(s + 1) * B]``, the same global batch as one process."""
    perm = epoch_permutation(n, seed, epoch)
    local = global_batch // world
    for s in range(n // global_batch):
        start = s * global_batch + rank * local
        yield perm[start:start + local]


# --------------------------------------------------------------------------- files

def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically."""
    import torch

    with atomic_write(path) as f:
        torch.save(obj, f)


def read_metrics(out: os.PathLike) -> List[Dict[str, Any]]:
    """The epoch records of ``out/metrics.jsonl`` (a torn last line is ignored)."""
    path = Path(out) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def load_checkpoint(path: os.PathLike, map_location="cpu") -> Dict[str, Any]:
    """A ``checkpoint.pt`` written by :func:`train` (read with ``weights_only=True``)."""
    import torch

    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise StructinitError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise StructinitError(f"{path} is not a structinit training checkpoint")
    return ck


def _config_differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    keys = sorted((set(old) | set(new)) - set(RESUME_FREE))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


# --------------------------------------------------------------------------- the run

def _amp_dtype(amp: str, device: str):
    import torch

    if amp not in AMP_MODES:
        raise UsageError(f"unknown --amp {amp!r}; choose one of {', '.join(AMP_MODES)}")
    if amp == "off" or (amp == "auto" and not device.startswith("cuda")):
        return None
    if amp == "fp16":
        return torch.float16
    if amp == "auto" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _init_model(config: TrainConfig, model) -> Optional[Dict[str, Any]]:
    if config.init is None:
        return None
    from .init_methods import initialize_model

    report = initialize_model(model, config.init, seed=config.seed, **config.init_params)
    return report


def _result_from_checkpoint(ck: Dict[str, Any], out: Path, ctx, t_start: float) -> TrainResult:
    metrics = list(ck["metrics"])
    return TrainResult(best_acc=float(ck["best_acc"]), best_epoch=int(ck["best_epoch"]),
                       last_acc=metrics[-1]["test_acc"] if metrics else float("nan"), epochs=len(metrics),
                       wall_seconds=float(ck.get("elapsed", 0.0)), params=dict(ck.get("params", {})), metrics=metrics,
                       out=str(out), resumed_from=int(ck["epoch"]), world_size=ctx.world, device=ctx.device)


class _Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


def train(config: TrainConfig, *, on_step: Optional[Callable[[int, int, int], None]] = None,
          on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
          log: Optional[Callable[[str], None]] = None) -> TrainResult:
    """Train ``config``; return the :class:`TrainResult` (also written to ``out/final.json``).

    Under ``torchrun`` every process calls this; each trains on its share of every global batch
    (DDP) and only rank 0 writes files and calls the callbacks: ``on_step(epoch, step, steps)``
    (1-based epoch), ``on_epoch(record)`` with the ``metrics.jsonl`` record, ``log(message)``.
    """
    import torch

    from . import distributed as dist_
    from .augment import BatchAugment, normalize
    from .datasets import dataset_info, load_dataset
    from .models import build_model, count_parameters

    t_start = time.perf_counter()
    info = dataset_info(config.dataset)
    recipe = config.validate()
    mcfg = config.model_config()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    out = Path(config.out) if config.out else None
    ctx = dist_.setup(config.device)
    try:
        if recipe["batch_size"] % ctx.world:
            raise UsageError(f"--batch-size {recipe['batch_size']} (the global batch) is not divisible by the "
                             f"{ctx.world} processes")
        say = log if (log and ctx.main) else (lambda msg: None)

        # ---- run directory: fresh, resumed or finished
        ck = None
        if out is not None:
            if out.exists() and not out.is_dir():
                raise UsageError(f"--out {out} exists and is not a directory")
            has_ck = (out / "checkpoint.pt").is_file()
            if not config.resume and (has_ck or (out / "final.json").is_file() or (out / "metrics.jsonl").is_file()):
                raise UsageError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
            if config.resume and (out / "config.json").is_file():
                try:
                    old = json.loads((out / "config.json").read_text())["config"]
                except (ValueError, KeyError) as exc:
                    raise StructinitError(f"{out / 'config.json'} is unreadable ({exc})") from None
                diff = _config_differences(old, config.to_dict())
                if diff:
                    raise UsageError(f"--resume with settings that differ from the run in {out}: {'; '.join(diff)}")
            if config.resume and has_ck:
                ck = load_checkpoint(out / "checkpoint.pt")

        epochs = int(recipe["epochs"])
        if ck is not None and int(ck["epoch"]) >= epochs and (out / "final.json").is_file():
            say(f"{out} finished all {epochs} epochs already")
            return _result_from_checkpoint(ck, out, ctx, t_start)

        # ---- data (with --download, rank 0 fetches while the others wait)
        if config.download and ctx.distributed and not ctx.main:
            dist_.barrier(ctx)
        data = load_dataset(config.dataset, config.data_dir, download=config.download, image_size=config.image_size)
        if config.download and ctx.distributed and ctx.main:
            dist_.barrier(ctx)
        info = data.info
        n_train = len(data.train)
        gb = int(recipe["batch_size"])
        steps = n_train // gb
        if steps < 1:
            raise UsageError(f"--batch-size {gb} is larger than the {n_train} training images of {config.dataset}")
        device = ctx.device
        dev = torch.device(device)

        # ---- model
        torch.manual_seed(config.seed)
        model = build_model(mcfg, num_classes=info.num_classes, image_size=info.image_size, in_chans=info.in_chans,
                            default_patch=info.default_patch, seed=config.seed)
        arch = model.structinit_arch
        init_report = _init_model(config, model)
        params = count_parameters(model)
        model.to(dev)
        trainable = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim > 1]
        no_decay = [p for p in trainable if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": recipe["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        try:  # the fused kernel is faster on CPU and GPU alike
            opt = torch.optim.AdamW(groups, lr=recipe["lr"], eps=recipe["opt_eps"], fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(groups, lr=recipe["lr"], eps=recipe["opt_eps"])
        amp_dtype = _amp_dtype(config.amp, device)
        scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 and device.startswith("cuda") else None
        net = model
        if ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[dev.index] if device.startswith("cuda") else None)
        if config.compile:
            net = torch.compile(net)

        # ---- state
        metrics: List[Dict[str, Any]] = []
        start_epoch, best_acc, best_epoch, elapsed_before = 0, -1.0, 0, 0.0
        if ck is not None:
            model.load_state_dict(ck["state_dict"])
            opt.load_state_dict(ck["optimizer"])
            if scaler is not None and ck.get("scaler"):
                scaler.load_state_dict(ck["scaler"])
            start_epoch = int(ck["epoch"])
            metrics = list(ck["metrics"])
            best_acc, best_epoch = float(ck["best_acc"]), int(ck["best_epoch"])
            elapsed_before = float(ck.get("elapsed", 0.0))
            rng = ck.get("rng", {})
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if device.startswith("cuda") and rng.get("cuda") is not None:
                torch.cuda.set_rng_state(rng["cuda"])
            say(f"resuming {out} after epoch {start_epoch}/{epochs}")
        if ctx.distributed:
            # Different augmentation/dropout draws per process, reproducible from the checkpointed state.
            torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,)).item()) + ctx.rank)

        resolved = {"recipe": recipe, "model": arch, "dataset": dataclasses.asdict(info), "params": params,
                    "steps_per_epoch": steps, "world_size": ctx.world, "device": device,
                    "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "off"}
        if out is not None and ctx.main:
            from . import __version__

            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "config.json", json.dumps(
                {"config": config.to_dict(), "resolved": resolved, "init_report": init_report,
                 "version": __version__}, indent=2, sort_keys=True, default=str) + "\n")
            # The checkpoint is the truth: drop epochs it does not have (a kill between the two writes).
            atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(m, sort_keys=True) + "\n" for m in metrics))
            if start_epoch < epochs:
                (out / "final.json").unlink(missing_ok=True)
        dist_.barrier(ctx)
        say(f"{config.model} ({params['trainable']:,} trainable params) on {config.dataset} "
            f"({n_train} train / {len(data.test)} test), {epochs} epochs x {steps} steps of {gb}, "
            f"{ctx.world} process(es) on {device}, init {config.init or 'default'}")

        # ---- data pipelines
        in_memory = info.in_memory
        aug = BatchAugment(recipe["augment"], flip=info.hflip, num_ops=int(recipe["randaug_n"]),
                           magnitude=int(recipe["randaug_m"])) if in_memory else None
        if in_memory:
            train_x, train_y = data.train.images.to(dev), data.train.labels.to(dev)
            test_x, test_y = data.test.images.to(dev), data.test.labels.to(dev)
        eval_b = int(config.eval_batch_size or max(gb, 1024))
        timer = _Timer(device)
        criterion = torch.nn.CrossEntropyLoss(label_smoothing=float(recipe["label_smoothing"]))
        total_steps = epochs * steps
        warmup_steps = int(round(float(recipe["warmup_epochs"]) * steps))

        def autocast():
            return torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None)

        def train_batches(epoch):
            if in_memory:
                for idx in shard_batches(n_train, gb, ctx.rank, ctx.world, config.seed, epoch):
                    idx = idx.to(dev)
                    x = aug(train_x[idx])
                    yield normalize(x, info.mean, info.std), train_y[idx]
            else:
                loader = torch.utils.data.DataLoader(
                    data.train, batch_sampler=list(shard_batches(n_train, gb, ctx.rank, ctx.world, config.seed, epoch)),
                    num_workers=config.workers, pin_memory=device.startswith("cuda"))
                for x, y in loader:
                    yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

        def evaluate():
            net.eval()
            sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss sum, correct, count
            n_test = len(data.test)
            lo, hi = n_test * ctx.rank // ctx.world, n_test * (ctx.rank + 1) // ctx.world
            with torch.inference_mode(), autocast():
                if in_memory:
                    chunks = ((normalize(test_x[i:min(i + eval_b, hi)], info.mean, info.std), test_y[i:min(i + eval_b, hi)])
                              for i in range(lo, hi, eval_b))
                else:
                    sub = torch.utils.data.Subset(data.test, range(lo, hi))
                    chunks = ((x.to(dev), y.to(dev)) for x, y in torch.utils.data.DataLoader(
                        sub, batch_size=eval_b, num_workers=config.workers, pin_memory=device.startswith("cuda")))
                for x, y in chunks:
                    logits = model(x)
                    sums[0] += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
                    sums[1] += (logits.argmax(-1) == y).sum().double()
                    sums[2] += y.numel()
            dist_.all_reduce_sum(ctx, sums)
            loss, correct, count = sums.tolist()
            return loss / max(count, 1), 100.0 * correct / max(count, 1)

        # ---- epochs
        for epoch in range(start_epoch, epochs):
            net.train()
            t0 = timer.now()
            acc_sum = torch.zeros(3, dtype=torch.float64, device=dev)  # loss sum, correct, count
            lr = recipe["lr"]
            for s, (x, y) in enumerate(train_batches(epoch)):
                step = epoch * steps + s
                lr = lr_at(step, total_steps, warmup_steps, recipe["lr"], recipe["min_lr"])
                for group in opt.param_groups:
                    group["lr"] = lr
                with autocast():
                    logits = net(x)
                    loss = criterion(logits.float(), y)
                opt.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                else:
                    loss.backward()
                if recipe["grad_clip"] > 0:
                    torch.nn.utils.clip_grad_norm_(trainable, recipe["grad_clip"])
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                with torch.no_grad():
                    acc_sum[0] += loss.detach().double() * y.numel()
                    acc_sum[1] += (logits.argmax(-1) == y).sum().double()
                    acc_sum[2] += y.numel()
                if on_step and ctx.main:
                    on_step(epoch + 1, s + 1, steps)
            t_train = timer.now() - t0
            dist_.all_reduce_sum(ctx, acc_sum)
            tr_loss, tr_correct, tr_count = acc_sum.tolist()
            if not math.isfinite(tr_loss):
                raise StructinitError(f"the loss diverged (not finite) in epoch {epoch + 1}; "
                                      f"try a lower --lr or --amp off")
            test_loss, test_acc = evaluate()
            if test_acc > best_acc:
                best_acc, best_epoch = test_acc, epoch + 1
                improved = True
            else:
                improved = False
            record = {"epoch": epoch + 1, "train_loss": tr_loss / max(tr_count, 1),
                      "train_acc": 100.0 * tr_correct / max(tr_count, 1), "test_loss": test_loss,
                      "test_acc": test_acc, "lr": lr, "images_per_s": tr_count / max(t_train, 1e-9),
                      "epoch_seconds": timer.now() - t0}
            metrics.append(record)
            if out is not None and ctx.main:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record, sort_keys=True) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                state = {"format": CHECKPOINT_FORMAT, "state_dict": model.state_dict(), "epoch": epoch + 1,
                         "arch": config.model, "args": config.to_dict(), "optimizer": opt.state_dict(),
                         "scaler": scaler.state_dict() if scaler is not None else None, "metrics": metrics,
                         "best_acc": best_acc, "best_epoch": best_epoch,
                         "elapsed": elapsed_before + time.perf_counter() - t_start, "params": params,
                         "rng": {"torch": torch.get_rng_state(),
                                 "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}}
                if improved:
                    atomic_torch_save({"state_dict": state["state_dict"], "epoch": epoch + 1, "arch": config.model,
                                       "args": config.to_dict(), "test_acc": test_acc}, out / "best.pt")
                atomic_torch_save(state, out / "checkpoint.pt")
            if on_epoch and ctx.main:
                on_epoch(record)
            dist_.barrier(ctx)

        wall = elapsed_before + time.perf_counter() - t_start
        result = TrainResult(best_acc=best_acc, best_epoch=best_epoch,
                             last_acc=metrics[-1]["test_acc"] if metrics else float("nan"), epochs=len(metrics),
                             wall_seconds=wall, params=params, metrics=metrics,
                             out=str(out) if out is not None else None,
                             resumed_from=start_epoch if ck is not None else None, world_size=ctx.world,
                             device=device, init_report=init_report)
        if out is not None and ctx.main:
            atomic_write_text(out / "final.json", json.dumps(result.summary(), indent=2, sort_keys=True) + "\n")
        return result
    finally:
        dist_.teardown(ctx)
