"""``train()``: the paper's training setup on one CPU, one GPU, or many under torchrun, in parts:
the optimizer (:func:`build_optimizer`), the schedule (:func:`lr_at`), the batches
(:func:`shard_batches`), one epoch (:func:`train_epoch`), evaluation (:func:`evaluate`) and the run
directory (:class:`~structinit.training.rundir.RunDir`).

Example::

    from structinit import TrainConfig, train
    result = train(TrainConfig(model="vit-digits", dataset="digits", init="impulse", epochs=40, out="runs/d"))
    result.final_acc   # test accuracy after the last epoch, in % (the headline)
    result.best_acc    # the best evaluated epoch's test accuracy (selected as result.best_on says)

``resume=True`` continues from ``checkpoint.pt``: the checkpoint is the source of truth,
``metrics.jsonl`` is rewritten from it, and data order and randomness are restored, so no epoch is
repeated or skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.training.config import EXECUTION_FIELDS, TrainConfig, causal_refused
from structinit.training.rundir import RunDir


@dataclass
class TrainResult:
    """What :func:`train` returns (its :meth:`summary` is ``final.json``). Accuracies in %.

    ``final_acc`` is the test accuracy after the last epoch (the headline). ``init_seconds``: the
    time the init took when the run started (its solve and data fit; ``None`` for the model's own
    init). ``best_acc`` /
    ``best_epoch`` are the test accuracy and epoch of the best evaluated epoch, chosen on the
    validation split when there is one (``best_on == "val"``), else on the test split itself
    (``best_on == "test"``, an optimistic figure).
    """

    final_acc: float
    best_acc: float
    best_epoch: int
    best_on: str
    epochs: int
    wall_seconds: float
    params: Dict[str, int]
    metrics: List[Dict[str, Any]]
    final_val_acc: Optional[float] = None
    out: Optional[str] = None
    key: Optional[str] = None
    resumed_from: Optional[int] = None
    world_size: int = 1
    device: str = "cpu"
    init_report: Optional[Dict[str, Any]] = None
    init_seconds: Optional[float] = None

    @property
    def last_acc(self) -> float:
        """Alias of :attr:`final_acc`."""
        return self.final_acc

    def summary(self) -> Dict[str, Any]:
        """The ``final.json`` content (no per-epoch metrics, no init report)."""
        return {"final_acc": self.final_acc, "final_val_acc": self.final_val_acc,
                "best_epoch": {"epoch": self.best_epoch, "test_acc": self.best_acc, "selected_on": self.best_on},
                "epochs": self.epochs, "wall_seconds": round(self.wall_seconds, 3), "params": self.params,
                "out": self.out, "key": self.key, "resumed_from": self.resumed_from, "world_size": self.world_size,
                "device": self.device, "init_seconds": self.init_seconds,
                "last": self.metrics[-1] if self.metrics else None}


# --------------------------------------------------------------------------- parts

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


def build_optimizer(model, hp: Dict[str, Any]):
    """AdamW over the trainable parameters (weight decay on matrices only): ``(optimizer, trainable)``."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim > 1], "weight_decay": hp["weight_decay"]},
              {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    try:  # the fused kernel is faster on CPU and GPU alike
        opt = torch.optim.AdamW(groups, lr=hp["lr"], eps=hp["opt_eps"], fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(groups, lr=hp["lr"], eps=hp["opt_eps"])
    return opt, trainable


def amp_dtype(amp: str, device: str):
    """The autocast dtype for ``amp`` on ``device`` (``None``: full precision)."""
    import torch

    if amp == "off" or (amp == "auto" and not device.startswith("cuda")):
        return None
    if amp == "fp16" or (amp == "auto" and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


@dataclass
class StepContext:
    """What one optimizer step needs besides the batch."""

    net: Any
    opt: Any
    trainable: List[Any]
    criterion: Any
    autocast: Callable[[], Any]
    grad_clip: float
    scaler: Any = None


def train_epoch(sc: StepContext, batches: Iterable[Tuple[Any, Any]], lr_for_step: Callable[[int], float],
                on_step: Optional[Callable[[int, int], None]] = None):
    """One pass over ``batches`` (``(x, y)`` pairs), the learning rate of step ``s`` (0-based, in
    this epoch) set to ``lr_for_step(s)`` before it. Returns ``(sums, lr)``: float64 ``[loss sum,
    correct, count]`` on the batches' device (not yet reduced over processes; on the CPU when there
    are none) and the last lr (NaN when there are none)."""
    import torch

    sc.net.train()
    sums = None
    lr = float("nan")
    for s, (x, y) in enumerate(batches):
        if sums is None:
            sums = torch.zeros(3, dtype=torch.float64, device=x.device)
        lr = lr_for_step(s)
        for group in sc.opt.param_groups:
            group["lr"] = lr
        with sc.autocast():
            logits = sc.net(x)
            loss = sc.criterion(logits.float(), y)
        sc.opt.zero_grad(set_to_none=True)
        if sc.scaler is not None:
            sc.scaler.scale(loss).backward()
            sc.scaler.unscale_(sc.opt)
        else:
            loss.backward()
        if sc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(sc.trainable, sc.grad_clip)
        if sc.scaler is not None:
            sc.scaler.step(sc.opt)
            sc.scaler.update()
        else:
            sc.opt.step()
        with torch.no_grad():
            sums += torch.stack([loss.detach().double() * y.numel(), (logits.argmax(-1) == y).sum().double(),
                                 torch.tensor(float(y.numel()), dtype=torch.float64, device=x.device)])
        if on_step:
            on_step(s + 1)
    return (torch.zeros(3, dtype=torch.float64) if sums is None else sums), lr  # no batches: nothing summed


def evaluate(model, chunks: Iterable[Tuple[Any, Any]], autocast: Callable[[], Any], device) -> Any:
    """Loss sum, correct and count (float64 ``[3]`` on ``device``, not reduced) of ``model`` over
    ``chunks`` of ``(x, y)``, in inference mode."""
    import torch

    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.inference_mode(), autocast():
        for x, y in chunks:
            logits = model(x)
            sums[0] += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum().double()
            sums[2] += y.numel()
    return sums


#: Training inputs on which the attention of an impulse-initialized model is measured at init.
FIDELITY_SAMPLES = 256


def init_inputs(split, info):
    """The first :data:`FIDELITY_SAMPLES` training inputs of an in-memory split, as the model sees
    them (images normalized; sequences as stored): what the init fits to (``data_fit``) and where
    its attention is measured at init."""
    from structinit.training.augment import normalize

    x = split.images[:FIDELITY_SAMPLES]
    return x if info.is_sequence else normalize(x, info.mean, info.std)


def impulse_fidelity(model, split, info, report: Dict[str, Any]) -> Dict[str, Any]:
    """The hit rate and target mass, per layer, of a freshly impulse-initialized model's attention on
    the first :data:`FIDELITY_SAMPLES` training inputs (see
    :func:`structinit.analysis.fidelity.data_attention_quality`); ``report`` is the init's report."""
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.geometry.grid import Grid

    x = init_inputs(split, info)
    solved = (report.get("artifact") or {}).get("config") or report  # impulse-2025 solves with no artifact
    rows = report["layers"]
    # No causal mask: the models train builds attend both ways (TrainConfig refuses causal offsets).
    return data_attention_quality(model, x, [r["offsets"] for r in rows], Grid(report["grid"]),
                                  padding=solved.get("padding", "zero"), layers=[r["layer"] for r in rows])


def _flat(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Settings with the init spec spelt as the options are (``init``, ``init_params.NAME``)."""
    out = {k: v for k, v in settings.items() if k != "init"}
    spec = settings.get("init")
    if isinstance(spec, dict):
        for name, value in spec.items():
            if name == "params" and isinstance(value, dict):
                out.update({f"init_params.{k}": v for k, v in value.items()})
            else:
                out["init" if name == "method" else f"init.{name}"] = value
    else:
        out["init"] = spec
    return out


def _shown(value: Any) -> str:
    """A setting's value as the error shows it: scalars as Python writes them, containers as JSON."""
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else repr(value)


def _differences(old: TrainConfig, new: TrainConfig) -> List[str]:
    a, b = _flat(old.computed_settings()), _flat(new.computed_settings())
    return [f"{k} {_shown(a.get(k))} in the run, {_shown(b.get(k))} now" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def _result_from_checkpoint(ck: Dict[str, Any], run: RunDir, ctx, key: str) -> TrainResult:
    """The result of a finished run, from its last checkpoint (which holds every epoch's record),
    as :func:`train` returned it (``final.json`` is not read: the checkpoint is the record)."""
    metrics = list(ck["metrics"])
    return TrainResult(final_acc=metrics[-1]["test_acc"], final_val_acc=metrics[-1].get("val_acc"),
                       best_acc=float(ck["best_acc"]),
                       best_epoch=int(ck["best_epoch"]), best_on=ck["best_on"], epochs=len(metrics),
                       wall_seconds=float(ck["elapsed"]), params=dict(ck["params"]),
                       metrics=metrics, out=str(run.path), key=key, resumed_from=int(ck["epoch"]),
                       world_size=ctx.world, device=ctx.device, init_seconds=ck.get("init_seconds"))


# --------------------------------------------------------------------------- the run

def train(config: TrainConfig, *, on_step: Optional[Callable[[int, int, int], None]] = None,
          on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
          log: Optional[Callable[[str], None]] = None,
          on_init: Optional[Callable[[int, int], None]] = None) -> TrainResult:
    """Train ``config``; return the :class:`TrainResult` (also written to ``out/final.json``).

    Under ``torchrun`` every process calls this; each trains on its share of every global batch
    (DDP) and only rank 0 writes files and calls the callbacks: ``on_step(epoch, step, steps)``
    (1-based epoch), ``on_epoch(record)`` with the ``metrics.jsonl`` record, ``log(message)``,
    ``on_init(done, total)`` as the init's data fit takes its steps. Any callback may raise to stop
    the run (an init stopped so leaves no files behind; the run starts afresh when resumed).
    """
    hp = config.validate()  # before torch is imported
    import torch

    from structinit import __version__
    from structinit.runtime import set_threads
    from structinit.training import distributed as dist_
    from structinit.training.augment import BatchAugment, normalize
    from structinit.training.datasets import load_dataset, split_train
    from structinit.training.models import build_model, count_parameters

    t_start = time.perf_counter()
    set_threads(config.threads)
    key = config.key
    run = RunDir(config.out) if config.out else None
    ctx = dist_.setup(config.device)
    locked = False
    try:
        if hp["batch_size"] % ctx.world:
            raise UsageError(f"{param('batch_size')} {hp['batch_size']} (the global batch) is not divisible by "
                             f"the {ctx.world} processes")
        say = log if (log and ctx.main) else (lambda msg: None)

        # ---- run directory: fresh, resumed or finished; held by this run alone
        ck, old = None, None
        if run is not None:
            _refuse_taken(run, config)  # before the lock, which would leave its file in someone else's folder
            if ctx.main:
                run.lock()  # a second process writing this folder is refused here, naming it
                locked = True
                _refuse_taken(run, config)
                if config.resume:
                    why = run.damage()
                    aside = run.set_aside()
                    if aside is not None:
                        moved = ", ".join(sorted(p.name for p in aside.iterdir() if p.name != "why.txt"))
                        say(f"{run.path} was damaged ({why}): moved {moved} into {aside}; "
                            + ("resuming from its checkpoint" if run.file(run.CHECKPOINT).exists()
                               else "training it afresh"))
            dist_.barrier(ctx)  # the other processes read the folder once rank 0 has made it sound
            old = run.read_config() if config.resume else None
            if old is not None:
                try:
                    old_config = TrainConfig.from_dict(old["config"])
                except (KeyError, TypeError, UsageError) as exc:
                    raise StructinitError(f"{run.file(run.CONFIG)} is unreadable ({exc})") from None
                diff = _differences(old_config, config)
                if diff:
                    raise UsageError(f"{param('resume')} with settings that differ from the run in {run.path}: "
                                     f"{'; '.join(diff)}")
            if config.resume and run.state != "fresh":
                ck = run.load_checkpoint()

        epochs = int(hp["epochs"])
        if ck is not None and int(ck["epoch"]) >= epochs and run.state == "finished":
            say(f"{run.path} finished all {epochs} epochs already")
            return _result_from_checkpoint(ck, run, ctx, key)

        # ---- data (with download, rank 0 fetches while the others wait)
        if config.download and ctx.distributed and not ctx.main:
            dist_.barrier(ctx)
        data = load_dataset(config.dataset, config.data_dir, download=config.download, image_size=config.image_size,
                            shuffle_seq=config.shuffle_seq)
        if config.download and ctx.distributed and ctx.main:
            dist_.barrier(ctx)
        data = split_train(data, config.train_size, config.val_size,
                           config.seed if config.data_seed is None else config.data_seed)
        info = data.info
        n_train = len(data.train)
        gb = int(hp["batch_size"])
        steps = n_train // gb
        if steps < 1:
            raise UsageError(f"{param('batch_size')} {gb} is larger than the {n_train} training images")
        device = ctx.device
        dev = torch.device(device)

        # ---- model
        torch.manual_seed(config.seed)
        model = build_model(config.model, num_classes=info.num_classes, image_size=info.image_size,
                            in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
        arch = model.structinit_arch
        spec = config.init
        init_report = None
        init_seconds = None
        init_record = None  # metrics.jsonl's epoch-0 line: the init's attention on real inputs
        recorded = (old or {}).get("init_report") if ck is not None else None
        if spec is not None and recorded is not None:
            from structinit.init.initialize import initialize_model

            # Resumed: the checkpoint holds every weight, so the init runs only for what it sets
            # besides them (which parameters train, such as a position embedding it makes
            # learnable), without its data fit; the run keeps the report and the epoch-0 attention
            # it recorded when it started.
            initialize_model(model, spec.without_fit() if spec.uses_data else spec, seed=config.seed)
            init_report = recorded
            init_seconds = (old or {}).get("init_seconds")
            if recorded.get("data_attention") is not None:
                init_record = {"epoch": 0, "init_attention": recorded["data_attention"]}
        elif spec is not None:
            from structinit.init.initialize import initialize_model

            fit_to = None
            if spec.uses_data:
                if info.in_memory:
                    fit_to = init_inputs(data.train, info)
                else:
                    say(f"the init's data fit needs training inputs held in memory and {config.dataset} is read "
                        "from disk: it runs on noise inputs of the model's input shape")
            t_init = time.perf_counter()
            source = (f"{config.dataset}: the run's first {int(fit_to.shape[0])} training inputs"
                      if fit_to is not None else None)
            init_report = initialize_model(model, spec, seed=config.seed, data=fit_to,
                                           progress=on_init if ctx.main else None, log=say, source=source)
            init_seconds = time.perf_counter() - t_init
            solved = init_report.get("artifact") or {}
            if (solved.get("config") or {}).get("causal"):  # an artifact given by path or key, read just now
                raise causal_refused(config.model.name, artifact=solved["key"])
            from structinit.init.registry import IMPULSE_METHODS

            if info.in_memory and init_report.get("method") in IMPULSE_METHODS:
                init_report["data_attention"] = impulse_fidelity(model, data.train, info, init_report)
                init_record = {"epoch": 0, "init_attention": init_report["data_attention"]}
                say(f"impulse attention at init on {init_report['data_attention']['samples']} training inputs: "
                    f"hit rate {init_report['data_attention']['hit_rate']:.3f}, target mass "
                    f"{init_report['data_attention']['target_mass']:.3f} (on the pseudo input: "
                    f"{init_report['hit_rate']:.3f}, {init_report['target_mass']:.3f})")
        params = count_parameters(model)
        model.to(dev)
        opt, trainable = build_optimizer(model, hp)
        dtype = amp_dtype(config.amp, device)
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 and device.startswith("cuda") else None
        net = model
        if ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[dev.index] if device.startswith("cuda") else None)
        if config.compile:
            net = torch.compile(net)

        # ---- state
        metrics: List[Dict[str, Any]] = []
        start_epoch, best_acc, best_score, best_epoch, elapsed_before = 0, -1.0, -1.0, 0, 0.0
        best_on = "val" if data.val is not None else "test"
        if ck is not None:
            model.load_state_dict(ck["state_dict"])
            opt.load_state_dict(ck["optimizer"])
            if scaler is not None and ck.get("scaler"):
                scaler.load_state_dict(ck["scaler"])
            start_epoch = int(ck["epoch"])
            metrics = list(ck["metrics"])
            best_acc, best_epoch = float(ck["best_acc"]), int(ck["best_epoch"])
            best_score = float(ck.get("best_score", best_acc))
            elapsed_before = float(ck.get("elapsed", 0.0))
            rng = ck.get("rng", {})
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if device.startswith("cuda") and rng.get("cuda") is not None:
                torch.cuda.set_rng_state(rng["cuda"])
            say(f"resuming {run.path} after epoch {start_epoch}/{epochs}")
        if ctx.distributed:
            # Different augmentation/dropout draws per process, reproducible from the checkpointed state.
            torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,)).item()) + ctx.rank)

        resolved = {"hparams": hp, "model": arch, "dataset": dataclasses.asdict(info), "params": params,
                    "train_images": n_train, "val_images": len(data.val) if data.val is not None else 0,
                    "steps_per_epoch": steps, "world_size": ctx.world, "device": device,
                    "amp": str(dtype).replace("torch.", "") if dtype else "off"}
        if run is not None and ctx.main:
            run.create()
            run.write_config({"config": config.to_dict(), "key": key, "resolved": resolved,
                              "init": spec.to_dict() if spec is not None else None, "init_report": init_report,
                              "init_seconds": None if init_seconds is None else round(init_seconds, 3),
                              "algorithms": spec.algorithms() if spec is not None else {},
                              "version": __version__})
            # the checkpoint is the truth: drop epochs it does not have (the epoch-0 line is the init's, rebuilt)
            run.write_metrics(([init_record] if init_record else []) + metrics)
            if start_epoch < epochs:
                run.clear_final()
        dist_.barrier(ctx)
        say(f"{config.model.name} ({params['trainable']:,} trainable params) on {config.dataset} "
            f"({n_train} train{f' / {len(data.val)} val' if data.val is not None else ''} / {len(data.test)} test), "
            f"{epochs} epochs x {steps} steps of {gb}, {ctx.world} process(es) on {device}, "
            f"init {config.init.method if config.init is not None else 'default'}")

        # ---- data pipelines
        in_memory = info.in_memory
        aug = BatchAugment(hp["augment"], flip=info.hflip, num_ops=int(hp["randaug_n"]),
                           magnitude=int(hp["randaug_m"])) if in_memory else None

        def prepare(x):  # uint8 images are normalized; sequences are used as stored (float, standardized)
            return x if info.is_sequence else normalize(x, info.mean, info.std)
        if in_memory:
            train_x, train_y = data.train.images.to(dev), data.train.labels.to(dev)
        eval_b = int(config.eval_batch_size or max(gb, 1024))
        total_steps = epochs * steps
        warmup_steps = int(round(float(hp["warmup_epochs"]) * steps))

        def autocast():
            return torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None)

        def batches(epoch):
            if in_memory:
                for idx in shard_batches(n_train, gb, ctx.rank, ctx.world, config.seed, epoch):
                    idx = idx.to(dev)
                    yield prepare(aug(train_x[idx])), train_y[idx]
            else:
                loader = torch.utils.data.DataLoader(
                    data.train, batch_sampler=list(shard_batches(n_train, gb, ctx.rank, ctx.world, config.seed, epoch)),
                    num_workers=config.workers, pin_memory=device.startswith("cuda"))
                for x, y in loader:
                    yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

        on_device: Dict[int, Tuple[Any, Any]] = {}

        def eval_split(split):
            n = len(split)
            lo, hi = n * ctx.rank // ctx.world, n * (ctx.rank + 1) // ctx.world
            if in_memory:
                if id(split) not in on_device:
                    on_device[id(split)] = (split.images[lo:hi].to(dev), split.labels[lo:hi].to(dev))
                xs, ys = on_device[id(split)]
                chunks = ((prepare(xs[i:i + eval_b]), ys[i:i + eval_b])
                          for i in range(0, hi - lo, eval_b))
            else:
                sub = torch.utils.data.Subset(split, range(lo, hi))
                chunks = ((x.to(dev), y.to(dev)) for x, y in torch.utils.data.DataLoader(
                    sub, batch_size=eval_b, num_workers=config.workers, pin_memory=device.startswith("cuda")))
            loss, correct, count = dist_.all_reduce_sum(ctx, evaluate(model, chunks, autocast, dev)).tolist()
            return loss / max(count, 1), 100.0 * correct / max(count, 1)

        # What apply/inspect cannot read off the weights (see structinit.init.checkpoints.SHAPE_KEY).
        shape = {"grid": list(arch["grid"]), "heads": arch.get("heads")}
        sc = StepContext(net=net, opt=opt, trainable=trainable, autocast=autocast, grad_clip=float(hp["grad_clip"]),
                         criterion=torch.nn.CrossEntropyLoss(label_smoothing=float(hp["label_smoothing"])),
                         scaler=scaler)
        eval_every = int(hp["eval_every"])

        # ---- epochs
        for epoch in range(start_epoch, epochs):
            t0 = _now(device)
            first_step = epoch * steps

            def lr_for_step(s: int, first: int = first_step) -> float:
                return lr_at(first + s, total_steps, warmup_steps, hp["lr"], hp["min_lr"])

            def step_done(s: int, e: int = epoch + 1) -> None:
                on_step(e, s, steps)

            sums, lr = train_epoch(sc, batches(epoch), lr_for_step,
                                   on_step=step_done if on_step and ctx.main else None)
            t_train = _now(device) - t0
            tr_loss, tr_correct, tr_count = dist_.all_reduce_sum(ctx, sums).tolist()
            if not math.isfinite(tr_loss):
                raise StructinitError(f"the loss diverged (not finite) in epoch {epoch + 1}; try a lower "
                                      f"{param('lr')} or {param('amp')} off")
            record = {"epoch": epoch + 1, "train_loss": tr_loss / max(tr_count, 1),
                      "train_acc": 100.0 * tr_correct / max(tr_count, 1), "lr": lr,
                      "images_per_s": tr_count / max(t_train, 1e-9)}
            improved = False
            if (epoch + 1) % eval_every == 0 or epoch + 1 == epochs:
                record["test_loss"], record["test_acc"] = eval_split(data.test)
                if data.val is not None:
                    record["val_loss"], record["val_acc"] = eval_split(data.val)
                score = record["val_acc" if data.val is not None else "test_acc"]
                if score > best_score:
                    best_score, best_acc, best_epoch, improved = score, record["test_acc"], epoch + 1, True
            record["epoch_seconds"] = _now(device) - t0
            metrics.append(record)
            if run is not None and ctx.main:
                run.append_metrics(record)
                state = {"state_dict": model.state_dict(), "epoch": epoch + 1, "arch": config.model.name,
                         "shape": shape, "args": config.to_dict(), "optimizer": opt.state_dict(),
                         "scaler": scaler.state_dict() if scaler is not None else None, "metrics": metrics,
                         "best_acc": best_acc, "best_score": best_score, "best_epoch": best_epoch, "best_on": best_on,
                         "elapsed": elapsed_before + time.perf_counter() - t_start, "params": params, "key": key,
                         "init_seconds": None if init_seconds is None else round(init_seconds, 3),
                         "rng": {"torch": torch.get_rng_state(),
                                 "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}}
                if improved:
                    run.save_best({"state_dict": state["state_dict"], "epoch": epoch + 1, "arch": config.model.name,
                                   "shape": shape,
                                   "args": config.to_dict(), "test_acc": best_acc, "selected_on": best_on})
                run.save_checkpoint(state)
            if on_epoch and ctx.main:
                on_epoch(record)
            dist_.barrier(ctx)

        last = metrics[-1] if metrics else {}
        result = TrainResult(final_acc=last.get("test_acc", float("nan")), final_val_acc=last.get("val_acc"),
                             best_acc=best_acc, best_epoch=best_epoch, best_on=best_on, epochs=len(metrics),
                             wall_seconds=elapsed_before + time.perf_counter() - t_start, params=params,
                             metrics=metrics, out=str(run.path) if run is not None else None, key=key,
                             resumed_from=start_epoch if ck is not None else None, world_size=ctx.world,
                             device=device, init_report=init_report,
                             init_seconds=None if init_seconds is None else round(init_seconds, 3))
        if run is not None and ctx.main:
            run.write_final(result.summary())
        return result
    except BaseException:
        if run is not None and ctx.main and run.opened:
            run.discard_unstarted()  # a run that failed before its first checkpoint leaves nothing behind
        raise
    finally:
        if locked:
            run.unlock()
        dist_.teardown(ctx)


def _refuse_taken(run: RunDir, config: TrainConfig) -> None:
    """A fresh run never writes into a folder that holds a run's files (whoever wrote them)."""
    if not config.resume and run.holds_run():
        names = (run.CONFIG, run.CHECKPOINT, run.BEST, run.FINAL, run.METRICS)
        found = [n for n in names if run.file(n).exists()]
        raise UsageError(f"{run.path} already holds a run ({', '.join(found)}); pass {param('resume')} to "
                         f"continue it or choose another {param('out')}")


def _now(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


__all__ = ["TrainConfig", "TrainResult", "train", "train_epoch", "evaluate", "build_optimizer", "lr_at",
           "shard_batches", "epoch_permutation", "EXECUTION_FIELDS"]
