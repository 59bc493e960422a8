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
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from structinit.errors import StructinitError, UsageError, param
from structinit.init.base import InitSpec
from structinit.init.report import InitReport
from structinit.training.config import EXECUTION_FIELDS, FIDELITY_SAMPLES, TrainConfig, causal_refused
from structinit.training.rundir import RunDir

if TYPE_CHECKING:  # torch is imported where it is used: validating a config does not load it
    import torch

    from structinit.training.datasets import Data, DatasetInfo, TensorSplit
    from structinit.training.distributed import DistContext


class TrainingStopped(Exception):
    """Raised by :func:`train` when its ``stop`` asked it to stop: every process stopped after the
    same optimizer step (or before an epoch). ``epochs_done``: the epochs in the run's checkpoint
    (0: none; a run folder then keeps nothing of this run)."""

    def __init__(self, epochs_done: int):
        super().__init__(f"stopped after {epochs_done} epoch(s)")
        self.epochs_done = epochs_done


@dataclass
class TrainResult:
    """What :func:`train` returns (its :meth:`summary` is ``final.json``). Accuracies in %.

    ``final_acc`` is the test accuracy after the last epoch (the headline). ``init_seconds``: the
    time the init took when the run started (its solve and data fit; ``None`` for the model's own
    init). ``best_acc`` /
    ``best_epoch`` are the test accuracy and epoch of the best evaluated epoch, chosen on the
    validation split when there is one (``best_on == "val"``), else on the test split itself
    (``best_on == "test"``, an optimistic figure). ``versions``: what the last epoch was trained
    under (:func:`structinit.runtime.software_versions`: Python, torch, timm, numpy, the platform,
    the device), kept beside the result and out of the run key.
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
    versions: Optional[Dict[str, str]] = None

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
                "last": self.metrics[-1] if self.metrics else None, "versions": self.versions}


# --------------------------------------------------------------------------- parts

def lr_at(step: int, total_steps: int, warmup_steps: int, lr: float, min_lr: float) -> float:
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    t = min((step - warmup_steps) / span, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The training order of ``epoch`` (0-based): a permutation of ``n`` from ``(seed, epoch)`` alone,
    identical on every process and after a resume."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def shard_batches(n: int, global_batch: int, rank: int, world: int, seed: int, epoch: int) -> Iterator[torch.Tensor]:
    """This process's index batches ``[global_batch // world]`` of ``epoch`` (drop-last): step ``s``
    of every process together covers ``perm[s * B:(s + 1) * B]``, the same global batch as one process."""
    perm = epoch_permutation(n, seed, epoch)
    local = global_batch // world
    for s in range(n // global_batch):
        start = s * global_batch + rank * local
        yield perm[start:start + local]


def build_optimizer(model: torch.nn.Module, hp: Dict[str, Any]
                    ) -> Tuple[torch.optim.Optimizer, List[torch.nn.Parameter]]:
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


def amp_dtype(amp: str, device: str) -> Optional[torch.dtype]:
    """The autocast dtype for ``amp`` on ``device`` (``None``: full precision)."""
    import torch

    if amp == "off" or (amp == "auto" and not device.startswith("cuda")):
        return None
    if amp == "fp16" or (amp == "auto" and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


def amp_name(dtype: Optional[torch.dtype]) -> str:
    """How a report names an autocast dtype of :func:`amp_dtype`: ``bfloat16``, ``float16`` or ``off``."""
    return str(dtype).replace("torch.", "") if dtype is not None else "off"


@dataclass
class StepContext:
    """What one optimizer step needs besides the batch."""

    net: Any  # the model, or its DDP / torch.compile wrapper (which torch types as a plain callable)
    opt: torch.optim.Optimizer
    trainable: List[torch.nn.Parameter]
    criterion: Callable[..., torch.Tensor]
    autocast: Callable[[], Any]
    grad_clip: float
    scaler: Optional[torch.amp.GradScaler] = None


def train_epoch(sc: StepContext, batches: Iterable[Tuple[Any, Any]], lr_for_step: Callable[[int], float],
                on_step: Optional[Callable[[int], None]] = None) -> Tuple[torch.Tensor, float]:
    """One pass over ``batches`` (``(x, y)`` pairs), the learning rate of step ``s`` (0-based, in
    this epoch) set to ``lr_for_step(s)`` before it and ``on_step(s + 1)`` called after it. Returns
    ``(sums, lr)``: float64 ``[loss sum, correct, count]`` on the batches' device (not yet reduced
    over processes; on the CPU when there are none) and the last lr (NaN when there are none)."""
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


def evaluate(model: torch.nn.Module, chunks: Iterable[Tuple[Any, Any]], autocast: Callable[[], Any],
             device: Union[str, torch.device]) -> torch.Tensor:
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




def init_inputs(split: TensorSplit, info: DatasetInfo) -> torch.Tensor:
    """The first :data:`FIDELITY_SAMPLES` training inputs of an in-memory split, as the model sees
    them (images normalized; sequences as stored): what the init fits to (``data_fit``) and where
    its attention is measured at init."""
    from structinit.training.augment import normalize

    x = split.images[:FIDELITY_SAMPLES]
    return x if info.is_sequence else normalize(x, info.mean, info.std)


def impulse_fidelity(model: torch.nn.Module, split: TensorSplit, info: DatasetInfo,
                     report: InitReport) -> Dict[str, Any]:
    """The hit rate and target mass, per layer, of a freshly impulse-initialized model's attention on
    the first :data:`FIDELITY_SAMPLES` training inputs (see
    :func:`structinit.analysis.fidelity.data_attention_quality`); ``report`` is the init's report."""
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.geometry.grid import Grid

    x = init_inputs(split, info)
    structure = report.structure
    if structure is None:
        raise StructinitError(f"the {report.method} init reported no impulse offsets to measure its attention on")
    layers = sorted(structure.offsets)
    # No causal mask: the models train builds attend both ways (TrainConfig refuses causal offsets).
    return data_attention_quality(model, x, [structure.offsets[i] for i in layers], Grid(structure.grid),
                                  padding=structure.padding, layers=layers)


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


def _result_from_checkpoint(ck: Dict[str, Any], run: RunDir, ctx: DistContext, key: str) -> TrainResult:
    """The result of a finished run, from its last checkpoint (which holds every epoch's record),
    as :func:`train` returned it (``final.json`` is not read: the checkpoint is the record)."""
    metrics = list(ck["metrics"])
    return TrainResult(final_acc=metrics[-1]["test_acc"], final_val_acc=metrics[-1].get("val_acc"),
                       best_acc=float(ck["best_acc"]),
                       best_epoch=int(ck["best_epoch"]), best_on=ck["best_on"], epochs=len(metrics),
                       wall_seconds=float(ck["elapsed"]), params=dict(ck["params"]),
                       metrics=metrics, out=str(run.path), key=key, resumed_from=int(ck["epoch"]),
                       world_size=ctx.world, device=ctx.device, init_seconds=ck.get("init_seconds"),
                       versions=ck.get("versions"))


# --------------------------------------------------------------------------- the run

def train(config: TrainConfig, *, on_step: Optional[Callable[[int, int, int], None]] = None,
          on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
          log: Optional[Callable[[str], None]] = None,
          on_init: Optional[Callable[[int, int], None]] = None,
          stop: Optional[Callable[[], bool]] = None) -> TrainResult:
    """Train ``config``; return the :class:`TrainResult` (also written to ``out/final.json``).

    Under ``torchrun`` every process calls this; each trains on its share of every global batch
    (DDP) and only rank 0 writes files and calls the callbacks: ``on_step(epoch, step, steps)``
    (1-based epoch), ``on_epoch(record)`` with the ``metrics.jsonl`` record, ``log(message)``,
    ``on_init(done, total)`` as the init's data fit takes its steps. Any callback may raise to stop
    the run (an init stopped so leaves no files behind; the run starts afresh when resumed).

    ``stop()`` is asked after every optimizer step and before every epoch, by every process (under
    torchrun each must pass one): when it says yes on any of them, all of them stop after that same
    step and :class:`TrainingStopped` is raised, the last epoch's checkpoint kept (e.g. on SIGTERM,
    which a scheduler sends to every process, each at its own moment of its step).

    The steps: the run folder is locked, made sound and read (:func:`_make_sound`,
    :func:`_open_run`), the data loaded (:func:`_load_data`), the model built and initialized
    (:func:`_initialized_model`), then trained (:func:`_train_model`); the lock is held until
    ``final.json`` is written.
    """
    hp = config.validate()  # before torch is imported
    from structinit.runtime import set_threads
    from structinit.training import distributed as dist_

    t_start = time.perf_counter()
    set_threads(config.threads)
    key = config.key
    run = RunDir(config.out) if config.out else None
    ctx = dist_.setup(config.device)
    locked: Optional[RunDir] = None  # the run folder while this process holds its lock
    try:
        if hp["batch_size"] % ctx.world:
            raise UsageError(f"{param('batch_size')} {hp['batch_size']} (the global batch) is not divisible by "
                             f"the {ctx.world} processes")
        s = _Session(config, hp, ctx, run, key, t_start, log if (log and ctx.main) else (lambda msg: None),
                     _stop_vote(ctx, stop) if stop is not None else None)
        old, ck = None, None
        if run is not None:
            _refuse_taken(run, config)  # before the lock, which would leave its file in someone else's folder
            if ctx.main:
                run.lock()  # a second process writing this folder is refused here, naming it
                locked = run
                _make_sound(s, run)
            old, ck = _open_run(s, run)
            epochs = int(hp["epochs"])
            if ck is not None and int(ck["epoch"]) >= epochs and run.state == "finished":
                s.say(f"{run.path} finished all {epochs} epochs already")
                return _result_from_checkpoint(ck, run, ctx, key)
        data = _load_data(s)
        built = _initialized_model(s, data, resumed=old if ck is not None else None, on_init=on_init)
        result = _train_model(s, data, built, ck, on_step=on_step, on_epoch=on_epoch)
        # Every process waits for rank 0's last writes before any tears the group down: a process that
        # destroyed its gloo group and exited while a peer still held it aborted that peer at exit
        # ("terminate called without an active exception", torchrun then failing the run).
        dist_.barrier(ctx)
        return result
    except BaseException:
        if run is not None and ctx.main and run.opened:
            run.discard_unstarted()  # a run that failed before its first checkpoint leaves nothing behind
        raise
    finally:
        if locked is not None:
            locked.unlock()
        dist_.teardown(ctx)


@dataclass
class _Session:
    """What the steps of one :func:`train` call share: the config and its resolved hyperparameters
    ``hp``, the process group ``ctx`` (:func:`structinit.training.distributed.setup`), the run folder
    (``None``: nothing is written), the run key, when the call started (``perf_counter``) and
    ``say`` (the ``log`` callback on rank 0, else silent)."""

    config: TrainConfig
    hp: Dict[str, Any]
    ctx: DistContext
    run: Optional[RunDir]
    key: str
    t_start: float
    say: Callable[[str], None]
    vote: Optional[Callable[[], bool]] = None  # ``stop`` as every process agrees on it (:func:`_stop_vote`)
    versions: Optional[Dict[str, str]] = None  # what it trains under (:func:`_versions`), found once

    @property
    def writer(self) -> Optional[RunDir]:
        """The run folder when this process writes the run's files (rank 0 of a run with a folder), else ``None``."""
        return self.run if self.ctx.main else None

    @property
    def epochs(self) -> int:
        """The number of epochs the run trains for."""
        return int(self.hp["epochs"])


@dataclass
class _Initialized:
    """The model :func:`train` built and initialized: ``arch`` is what it was built as
    (``model.structinit_arch``); ``report`` and ``seconds`` the init's report and time (``None``
    for the model's own init); ``record`` the epoch-0 line of ``metrics.jsonl``, the init's attention
    on real inputs (``None`` when it is not measured)."""

    model: torch.nn.Module
    arch: Dict[str, Any]
    report: Optional[InitReport] = None
    seconds: Optional[float] = None
    record: Optional[Dict[str, Any]] = None

    @property
    def rounded_seconds(self) -> Optional[float]:
        """``seconds`` to the millisecond, as the run's files hold it."""
        return None if self.seconds is None else round(self.seconds, 3)


@dataclass
class _Progress:
    """Where a run stands: the records of the epochs done (``metrics``), the epoch this session
    started after and the one it resumed from (``None``: started afresh), the best evaluated epoch
    (its test accuracy, the score it was chosen by, its number, the split chosen on) and the wall
    time of earlier sessions."""

    best_on: str
    metrics: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    start_epoch: int = 0
    resumed_from: Optional[int] = None
    best_acc: float = -1.0
    best_score: float = -1.0
    best_epoch: int = 0
    elapsed_before: float = 0.0

    def elapsed(self, t_start: float) -> float:
        """Seconds of training over every session, this one started at ``t_start``."""
        return self.elapsed_before + time.perf_counter() - t_start


# --------------------------------------------------------------------------- the run folder

def _make_sound(s: _Session, run: RunDir) -> None:
    """On rank 0, with the lock held: refuse a folder another run took in the meantime; when
    resuming, set a damaged folder's files aside (saying where). ``run`` is ``s.run``."""
    _refuse_taken(run, s.config)
    if s.config.resume:
        why = run.damage()
        aside = run.set_aside()
        if aside is not None:
            moved = ", ".join(sorted(p.name for p in aside.iterdir() if p.name != run.WHY))
            s.say(f"{run.path} was damaged ({why}): moved {moved} into {aside}; "
                  + ("resuming from its checkpoint" if run.file(run.CHECKPOINT).exists() else "training it afresh"))


def _open_run(s: _Session, run: RunDir) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """``(config.json, checkpoint)`` of the run being resumed (``None`` each when there is none),
    read by every process once rank 0 has made the folder sound; resuming with settings that change
    what is computed is refused, naming them. ``run`` is ``s.run``."""
    from structinit.training import distributed as dist_

    config = s.config
    dist_.barrier(s.ctx)  # the other processes read the folder once rank 0 has made it sound
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
    ck = run.load_checkpoint() if config.resume and run.state != "fresh" else None
    return old, ck


def _write_start(s: _Session, run: RunDir, built: _Initialized, progress: _Progress, resolved: Dict[str, Any]) -> None:
    """Rank 0 writes the run's ``config.json`` (settings, key, ``resolved`` setup, the init and its
    report) and ``metrics.jsonl`` as the checkpoint has it (the epoch-0 line is the init's, rebuilt),
    and drops a ``final.json`` the run will write anew. ``run`` is ``s.run``."""
    from structinit import __version__

    spec = s.config.init
    run.create()
    run.write_config({"config": s.config.to_dict(), "key": s.key, "resolved": resolved,
                      "init": spec.to_dict() if spec is not None else None, "init_report": _report_json(built),
                      "init_seconds": built.rounded_seconds,
                      "algorithms": spec.algorithms() if spec is not None else {},
                      "version": __version__, "versions": _versions(s)})
    run.write_metrics(([built.record] if built.record else []) + progress.metrics)
    if progress.start_epoch < s.epochs:
        run.clear_final()


def _save_epoch(s: _Session, run: RunDir, built: _Initialized, sc: StepContext, progress: _Progress,
                params: Dict[str, int], epoch: int, improved: bool) -> None:
    """Rank 0 saves ``checkpoint.pt`` into ``run`` (``s.run``) after ``epoch`` (1-based: the epochs
    done; everything a resume needs, RNG states included) and, when it ``improved`` on the best
    epoch, ``best.pt``."""
    import torch

    config, device = s.config, s.ctx.device
    # What apply/inspect cannot read off the weights (see structinit.init.checkpoints.SHAPE_KEY).
    shape = {"grid": list(built.arch["grid"]), "heads": built.arch.get("heads")}
    state = {"state_dict": built.model.state_dict(), "epoch": epoch, "arch": config.model.name, "shape": shape,
             "args": config.to_dict(), "optimizer": sc.opt.state_dict(),
             "scaler": sc.scaler.state_dict() if sc.scaler is not None else None, "metrics": progress.metrics,
             "best_acc": progress.best_acc, "best_score": progress.best_score, "best_epoch": progress.best_epoch,
             "best_on": progress.best_on, "elapsed": progress.elapsed(s.t_start), "params": params, "key": s.key,
             "init_seconds": built.rounded_seconds, "versions": _versions(s),
             "rng": {"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}}
    if improved:
        run.save_best({"state_dict": state["state_dict"], "epoch": epoch, "arch": config.model.name,
                       "shape": shape, "args": config.to_dict(), "test_acc": progress.best_acc,
                       "selected_on": progress.best_on})
    run.save_checkpoint(state)


# --------------------------------------------------------------------------- data and model

def _load_data(s: _Session) -> Data:
    """The run's dataset with its training subset and validation split drawn (with ``download``
    under torchrun, rank 0 fetches while the others wait); refused when one global batch is larger
    than the training split."""
    from structinit.training import distributed as dist_
    from structinit.training.datasets import load_dataset, split_train

    config, ctx = s.config, s.ctx
    if config.download and ctx.distributed and not ctx.main:
        dist_.barrier(ctx)
    data = load_dataset(config.dataset, config.data_dir, download=config.download, image_size=config.image_size,
                        shuffle_seq=config.shuffle_seq)
    if config.download and ctx.distributed and ctx.main:
        dist_.barrier(ctx)
    data = split_train(data, config.train_size, config.val_size,
                       config.seed if config.data_seed is None else config.data_seed)
    gb, n_train = int(s.hp["batch_size"]), len(data.train)
    if n_train // gb < 1:
        raise UsageError(f"{param('batch_size')} {gb} is larger than the {n_train} training images")
    return data


def _initialized_model(s: _Session, data: Data, resumed: Optional[Dict[str, Any]],
                       on_init: Optional[Callable[[int, int], None]]) -> _Initialized:
    """The run's model, built from its seed, with its init applied: in full when the run starts
    (:func:`_apply_init`); when it resumes from a checkpoint whose ``config.json`` (``resumed``)
    recorded the init's report, only for what the init sets besides the weights
    (:func:`_reapply_init`)."""
    import torch

    from structinit.training.models import build_model

    config, info = s.config, data.info
    torch.manual_seed(config.seed)
    model = build_model(config.model, num_classes=info.num_classes, image_size=info.image_size,
                        in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
    built = _Initialized(model, model.structinit_arch)
    started = resumed or {}
    recorded = started.get("init_report")
    spec = config.init
    if spec is None:
        return built
    if recorded is not None:
        return _reapply_init(built, config, spec, recorded, started.get("init_seconds"))
    return _apply_init(built, s, spec, data, on_init)


def _reapply_init(built: _Initialized, config: TrainConfig, spec: InitSpec, recorded: Dict[str, Any],
                  seconds: Optional[float]) -> _Initialized:
    """Resumed: the checkpoint holds every weight, so the init runs only for what it sets besides
    them (which parameters train, such as a position embedding it makes learnable), without its data
    fit; the run keeps the report (``recorded``), the time and the epoch-0 attention it recorded when
    it started. ``spec`` is ``config.init``."""
    from structinit.init.initialize import initialize_model

    initialize_model(built.model, spec.without_fit(), seed=config.seed)
    try:
        built.report, built.seconds = InitReport.from_dict(recorded), seconds
    except ValueError as exc:
        raise StructinitError(f"the init report the run recorded cannot be read: {exc}") from None
    if built.report.data_attention is not None:
        built.record = {"epoch": 0, "init_attention": built.report.data_attention}
    return built


def _apply_init(built: _Initialized, s: _Session, spec: InitSpec, data: Data,
                on_init: Optional[Callable[[int, int], None]]) -> _Initialized:
    """The init (``spec``, the config's) of a run that starts: fitted to the run's first training
    inputs when it fits to data (noise inputs for a dataset read from disk), timed; an impulse
    init's attention is then measured on those inputs (:func:`impulse_fidelity`) for the report and
    the epoch-0 record."""
    from structinit.init.initialize import initialize_model

    config, info, say = s.config, data.info, s.say
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
    report = initialize_model(built.model, spec, seed=config.seed, data=fit_to,
                              progress=on_init if s.ctx.main else None, log=say, source=source)
    built.report, built.seconds = report, time.perf_counter() - t_init
    if report.structure is not None and report.structure.causal:  # an artifact given by path or key, read just now
        raise causal_refused(config.model.name, artifact=report.structure.artifact)
    if info.in_memory and spec.reports_offsets:
        quality = report.data_attention = impulse_fidelity(built.model, data.train, info, report)
        built.record = {"epoch": 0, "init_attention": quality}
        say(f"impulse attention at init on {quality['samples']} training inputs: hit rate {quality['hit_rate']:.3f}, "
            f"target mass {quality['target_mass']:.3f} (on the pseudo input: {report.hit_rate or 0:.3f}, "
            f"{report.target_mass or 0:.3f})")
    return built


# --------------------------------------------------------------------------- training

def _train_model(s: _Session, data: Data, built: _Initialized, ck: Optional[Dict[str, Any]], *,
                 on_step: Optional[Callable[[int, int, int], None]],
                 on_epoch: Optional[Callable[[Dict[str, Any]], None]]) -> TrainResult:
    """Train the initialized model from its first epoch, or from checkpoint ``ck``, to the last;
    the run's files are written as it goes, ``final.json`` last."""
    import torch

    from structinit.training import distributed as dist_
    from structinit.training.models import count_parameters

    ctx, info = s.ctx, data.info
    params = count_parameters(built.model)
    sc, dtype = _step_context(s, built.model)
    progress = _Progress(best_on="val" if data.val is not None else "test")
    if ck is not None:
        _restore(s, ck, built.model, sc, progress)
    if ctx.distributed:
        # Different augmentation/dropout draws per process, reproducible from the checkpointed state.
        torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,)).item()) + ctx.rank)
    feed = _Feed(s, data, sc.autocast)
    n_train, steps = len(data.train), feed.steps
    resolved = {"hparams": s.hp, "model": built.arch, "dataset": dataclasses.asdict(info), "params": params,
                "train_images": n_train, "val_images": len(data.val) if data.val is not None else 0,
                "steps_per_epoch": steps, "world_size": ctx.world, "device": ctx.device,
                "amp": amp_name(dtype)}
    writer = s.writer
    if writer is not None:
        _write_start(s, writer, built, progress, resolved)
    dist_.barrier(ctx)
    init = s.config.init.method if s.config.init is not None else "default"
    s.say(f"{s.config.model.name} ({params['trainable']:,} trainable params) on {s.config.dataset} "
          f"({n_train} train{f' / {len(data.val)} val' if data.val is not None else ''} / {len(data.test)} test), "
          f"{s.epochs} epochs x {steps} steps of {feed.global_batch}, {ctx.world} process(es) on {ctx.device}, "
          f"init {init}")
    for epoch in range(progress.start_epoch, s.epochs):
        if s.vote is not None and s.vote():
            raise TrainingStopped(epoch)
        record, improved = _train_one_epoch(s, sc, feed, built.model, progress, epoch, on_step)
        progress.metrics.append(record)
        if writer is not None:
            writer.append_metrics(record)
            _save_epoch(s, writer, built, sc, progress, params, epoch + 1, improved)
        if on_epoch and ctx.main:
            on_epoch(record)
        dist_.barrier(ctx)
    result = _result(s, progress, built, params)
    if writer is not None:
        writer.write_final(result.summary())
    return result


def _step_context(s: _Session, model: torch.nn.Module) -> Tuple[StepContext, Optional[torch.dtype]]:
    """``(step context, autocast dtype)``: the model moved to the run's device, its AdamW, the
    mixed precision (``None``: full precision; fp16 on a GPU adds a grad scaler), the model wrapped
    for DDP and ``torch.compile`` as the run asks, and the loss."""
    import torch

    config, hp, ctx = s.config, s.hp, s.ctx
    device = ctx.device
    dev = torch.device(device)
    model.to(dev)
    opt, trainable = build_optimizer(model, hp)
    dtype = amp_dtype(config.amp, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 and device.startswith("cuda") else None
    net: Any = model  # what the steps call: the model, wrapped for DDP and compiled as asked
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[dev.index] if device.startswith("cuda") else None)
    if config.compile:
        net = torch.compile(net)

    def autocast() -> torch.autocast:
        return torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None)

    sc = StepContext(net=net, opt=opt, trainable=trainable, autocast=autocast, grad_clip=float(hp["grad_clip"]),
                     criterion=torch.nn.CrossEntropyLoss(label_smoothing=float(hp["label_smoothing"])), scaler=scaler)
    return sc, dtype


def _restore(s: _Session, ck: Dict[str, Any], model: torch.nn.Module, sc: StepContext, progress: _Progress) -> None:
    """Resume from checkpoint ``ck``: the weights, the optimizer and grad scaler, the epochs done
    and the best one, the time spent, and the RNG states (so the data order and augmentation go on
    as if never stopped)."""
    import torch

    model.load_state_dict(ck["state_dict"])
    sc.opt.load_state_dict(ck["optimizer"])
    if sc.scaler is not None and ck.get("scaler"):
        sc.scaler.load_state_dict(ck["scaler"])
    progress.start_epoch = progress.resumed_from = int(ck["epoch"])
    progress.metrics = list(ck["metrics"])
    progress.best_acc, progress.best_epoch = float(ck["best_acc"]), int(ck["best_epoch"])
    progress.best_score = float(ck.get("best_score", progress.best_acc))
    progress.elapsed_before = float(ck.get("elapsed", 0.0))
    rng = ck.get("rng", {})
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if s.ctx.device.startswith("cuda") and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    assert s.run is not None  # a checkpoint is read from the run's folder
    s.say(f"resuming {s.run.path} after epoch {progress.start_epoch}/{s.epochs}")


class _Feed:
    """The data of one run on its device: :meth:`batches` gives this process's share of an epoch's
    training batches (augmented, then normalized), :meth:`evaluate` a model's loss and accuracy on a
    split (over every process). Data held in memory is moved to the device once; data read from disk
    goes through DataLoaders with the run's ``workers``."""

    def __init__(self, s: _Session, data: Data, autocast: Callable[[], Any]) -> None:
        import torch

        from structinit.training.augment import BatchAugment

        hp, info = s.hp, data.info
        self.data, self.info, self.ctx, self.autocast = data, info, s.ctx, autocast
        self.seed, self.workers = s.config.seed, s.config.workers
        self.dev = torch.device(s.ctx.device)
        self.pin = s.ctx.device.startswith("cuda")
        self.global_batch = int(hp["batch_size"])
        self.eval_batch = int(s.config.eval_batch_size or max(self.global_batch, 1024))
        self.aug = BatchAugment(hp["augment"], flip=info.hflip, num_ops=int(hp["randaug_n"]),
                                magnitude=int(hp["randaug_m"])) if info.in_memory else None
        if info.in_memory:
            self.train_x, self.train_y = data.train.images.to(self.dev), data.train.labels.to(self.dev)
        self._on_device: Dict[int, Tuple[Any, Any]] = {}

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch (whole global batches; the rest of the data waits for a later epoch)."""
        return len(self.data.train) // self.global_batch

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images normalized; sequences as stored (float, standardized)."""
        from structinit.training.augment import normalize

        return x if self.info.is_sequence else normalize(x, self.info.mean, self.info.std)

    def batches(self, epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """This process's ``(x, y)`` batches of ``epoch`` (0-based), on the device."""
        import torch

        n, ctx = len(self.data.train), self.ctx
        if self.info.in_memory:
            aug = self.aug
            assert aug is not None  # made for data held in memory
            for idx in shard_batches(n, self.global_batch, ctx.rank, ctx.world, self.seed, epoch):
                idx = idx.to(self.dev)
                yield self.prepare(aug(self.train_x[idx])), self.train_y[idx]
        else:
            batches = list(shard_batches(n, self.global_batch, ctx.rank, ctx.world, self.seed, epoch))
            # torch types batch_sampler as lists of indices; the loader iterates an index tensor just the same
            loader = torch.utils.data.DataLoader(self.data.train, batch_sampler=batches,  # type: ignore[arg-type]
                                                 num_workers=self.workers, pin_memory=self.pin,
                                                 worker_init_fn=_loader_worker_start)
            for x, y in _started(loader):
                yield x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)

    def evaluate(self, model: torch.nn.Module, split: Any) -> Tuple[float, float]:
        """``(mean loss, accuracy in %)`` of ``model`` on ``split`` (one of the data's, in memory or a
        torch ``Dataset``), each process taking a slice."""
        import torch

        from structinit.training import distributed as dist_

        n, ctx, dev, eval_b = len(split), self.ctx, self.dev, self.eval_batch
        lo, hi = n * ctx.rank // ctx.world, n * (ctx.rank + 1) // ctx.world
        if self.info.in_memory:
            if id(split) not in self._on_device:
                self._on_device[id(split)] = (split.images[lo:hi].to(dev), split.labels[lo:hi].to(dev))
            xs, ys = self._on_device[id(split)]
            chunks = ((self.prepare(xs[i:i + eval_b]), ys[i:i + eval_b]) for i in range(0, hi - lo, eval_b))
        else:
            sub = torch.utils.data.Subset(split, range(lo, hi))
            chunks = ((x.to(dev), y.to(dev)) for x, y in _started(torch.utils.data.DataLoader(
                sub, batch_size=eval_b, num_workers=self.workers, pin_memory=self.pin,
                worker_init_fn=_loader_worker_start)))
        loss, correct, count = dist_.all_reduce_sum(ctx, evaluate(model, chunks, self.autocast, dev)).tolist()
        return loss / max(count, 1), 100.0 * correct / max(count, 1)


#: The signals a scheduler sends every process of a job to stop it, which a DataLoader worker leaves
#: to the process that trains (:func:`_loader_worker_start`).
_STOP_SIGNALS = ("SIGTERM", "SIGUSR2")


def _started(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader``, its workers started with the stop signals blocked (a forked process
    keeps the signal mask of the thread that forked it), so that one sent to every process of the
    job while a worker starts waits for :func:`_loader_worker_start` instead of ending it."""
    import signal

    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: torch's own handling (see _loader_worker_start)
        yield from loader
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {getattr(signal, name) for name in _STOP_SIGNALS})
    try:
        batches = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    yield from batches


def _loader_worker_start(worker_id: int) -> None:
    """In a DataLoader worker: leave SIGTERM and SIGUSR2 to the process that trains. A scheduler
    sends them to every process of a job; torch's worker dies of a SIGTERM that its trainer did
    not send, and the trainer then fails on "DataLoader worker ... is killed by signal" instead of
    stopping at its next step. Both stay blocked (as the worker started, :func:`_started`) and a
    thread takes them, ending the worker on its trainer's SIGTERM alone (torch's last resort for a
    worker that does not exit)."""
    import os
    import signal
    import threading

    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: torch's own handling stays
        return
    trainer = os.getppid()
    stops = {getattr(signal, name) for name in _STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # threads started from here on keep it blocked

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(stops)
            if info.si_signo == signal.SIGTERM and info.si_pid == trainer:
                os._exit(0)

    threading.Thread(target=take, name="stop-signals", daemon=True).start()


def _train_one_epoch(s: _Session, sc: StepContext, feed: _Feed, model: torch.nn.Module, progress: _Progress, epoch: int,
                     on_step: Optional[Callable[[int, int, int], None]]) -> Tuple[Dict[str, Any], bool]:
    """Train ``epoch`` (0-based) and evaluate it when it is due (every ``eval_every`` epochs and the
    last): ``(its metrics.jsonl record, whether it is the new best)``; ``progress``'s best epoch is
    updated. A loss that is not finite stops the run."""
    from structinit.training import distributed as dist_

    hp, ctx, device = s.hp, s.ctx, s.ctx.device
    data, epochs, steps = feed.data, s.epochs, feed.steps
    total_steps, warmup_steps = epochs * steps, int(round(float(hp["warmup_epochs"]) * steps))
    t0 = _now(device)
    first_step = epoch * steps

    def lr_for_step(step: int) -> float:
        return lr_at(first_step + step, total_steps, warmup_steps, hp["lr"], hp["min_lr"])

    step_done = _epoch_steps(on_step if ctx.main else None, s.vote, epoch, steps)
    sums, lr = train_epoch(sc, feed.batches(epoch), lr_for_step, on_step=step_done)
    t_train = _now(device) - t0
    tr_loss, tr_correct, tr_count = dist_.all_reduce_sum(ctx, sums).tolist()
    if not math.isfinite(tr_loss):
        raise StructinitError(f"the loss diverged (not finite) in epoch {epoch + 1}; try a lower "
                              f"{param('lr')} or {param('amp')} off")
    record = {"epoch": epoch + 1, "train_loss": tr_loss / max(tr_count, 1),
              "train_acc": 100.0 * tr_correct / max(tr_count, 1), "lr": lr,
              "images_per_s": tr_count / max(t_train, 1e-9)}
    improved = False
    if (epoch + 1) % int(hp["eval_every"]) == 0 or epoch + 1 == epochs:
        record["test_loss"], record["test_acc"] = feed.evaluate(model, data.test)
        if data.val is not None:
            record["val_loss"], record["val_acc"] = feed.evaluate(model, data.val)
        score = record["val_acc" if data.val is not None else "test_acc"]
        if score > progress.best_score:
            progress.best_score, progress.best_acc, progress.best_epoch = score, record["test_acc"], epoch + 1
            improved = True
    record["epoch_seconds"] = _now(device) - t0
    return record, improved


def _epoch_steps(on_step: Optional[Callable[[int, int, int], None]], vote: Optional[Callable[[], bool]], epoch: int,
                 steps: int) -> Optional[Callable[[int], None]]:
    """What :func:`train_epoch` calls after each step of ``epoch`` (0-based) with the step alone:
    ``on_step(epoch + 1, step, steps)``, then ``vote()``, which raises :class:`TrainingStopped`
    when the processes agree to stop. ``None`` when there is neither."""
    if on_step is None and vote is None:
        return None

    def step_done(step: int) -> None:
        if on_step is not None:
            on_step(epoch + 1, step, steps)
        if vote is not None and vote():
            raise TrainingStopped(epoch)

    return step_done


def _stop_vote(ctx: DistContext, stop: Callable[[], bool]) -> Callable[[], bool]:
    """``stop`` as every process agrees on it: alone, its own answer; under torchrun, yes on all
    of them when any says yes (a MAX all-reduce at every call, so each process must call it at the
    same points). It goes over gloo on the CPU, so that a GPU run does not wait for its device at
    every step."""
    if not ctx.distributed:
        return stop
    import torch
    import torch.distributed as dist

    group = None
    if ctx.backend != "gloo":
        made = dist.new_group(backend="gloo")
        assert isinstance(made, dist.ProcessGroup)  # every process is a member
        group = made

    def vote() -> bool:
        flag = torch.tensor([1 if stop() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    return vote


def _result(s: _Session, progress: _Progress, built: _Initialized, params: Dict[str, int]) -> TrainResult:
    """The :class:`TrainResult` of a run that trained to its last epoch."""
    last = progress.metrics[-1] if progress.metrics else {}
    return TrainResult(final_acc=last.get("test_acc", float("nan")), final_val_acc=last.get("val_acc"),
                       best_acc=progress.best_acc, best_epoch=progress.best_epoch, best_on=progress.best_on,
                       epochs=len(progress.metrics), wall_seconds=progress.elapsed(s.t_start), params=params,
                       metrics=progress.metrics, out=str(s.run.path) if s.run is not None else None, key=s.key,
                       resumed_from=progress.resumed_from, world_size=s.ctx.world, device=s.ctx.device,
                       init_report=_report_json(built), init_seconds=built.rounded_seconds, versions=_versions(s))


def _report_json(built: _Initialized) -> Optional[Dict[str, Any]]:
    """The init's report as the run's files hold it (``None``: the model's own init)."""
    return built.report.to_dict() if built.report is not None else None


def _versions(s: _Session) -> Dict[str, str]:
    """What this session trains under (:func:`structinit.runtime.software_versions`), found once."""
    if s.versions is None:
        from structinit.runtime import software_versions

        s.versions = software_versions(s.ctx.device)
    return s.versions


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


__all__ = ["TrainConfig", "TrainResult", "TrainingStopped", "train", "train_epoch", "evaluate", "build_optimizer",
           "lr_at", "shard_batches", "epoch_permutation", "EXECUTION_FIELDS"]
