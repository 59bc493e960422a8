"""``train()``: the paper's training setup on one CPU, one GPU, or many under torchrun, put
together from its parts: the session and its run folder (:mod:`structinit.training.session`), the
init at start (:mod:`structinit.training.init_at_start`), one pass of training and its optimizer,
schedule and batches (:mod:`structinit.training.steps`), the data on its device and evaluation
(:mod:`structinit.training.feed`) and the result (:mod:`structinit.training.result`). This module
holds the run from start to end and the epoch loop.

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
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.training.config import EXECUTION_FIELDS, FIDELITY_SAMPLES, TrainConfig
from structinit.training.init_at_start import Initialized, init_inputs, initialized_model
from structinit.training.result import Progress, TrainingStopped, TrainResult, result_from_checkpoint
from structinit.training.rundir import RunDir
from structinit.training.session import Session, refuse_taken, stop_vote
from structinit.training.steps import (
    StepContext,
    amp_dtype,
    amp_name,
    build_optimizer,
    epoch_permutation,
    evaluate,
    lr_at,
    shard_batches,
    train_epoch,
)

if TYPE_CHECKING:  # torch is imported where it is used: validating a config does not load it
    import torch

    from structinit.training.datasets import Data
    from structinit.training.feed import Feed


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

    The steps: the run folder is locked, made sound and read (:meth:`Session.make_sound`,
    :meth:`Session.open_run`), the data loaded (:meth:`Session.load_data`), the model built and
    initialized (:func:`~structinit.training.init_at_start.initialized_model`), then trained
    (:func:`_train_model`); the lock is held until ``final.json`` is written.
    """
    hp = config.validate()  # before torch is imported
    from structinit.runtime import set_threads
    from structinit.training import distributed as dist_

    t_start = time.perf_counter()
    set_threads(config.threads)
    key = config.key
    run = RunDir(config.out) if config.out else None
    world = dist_.planned_world()
    if hp["batch_size"] % world:  # before the process group: no process is left waiting for one that quit
        raise UsageError(f"{param('batch_size')} {hp['batch_size']} (the global batch) is not divisible by "
                         f"the {world} processes")
    ctx = dist_.setup(config.device)
    locked: Optional[RunDir] = None  # the run folder while this process holds its lock
    try:
        s = Session(config, hp, ctx, run, key, t_start, log if (log and ctx.main) else (lambda msg: None),
                    stop_vote(ctx, stop) if stop is not None else None)
        old, ck = None, None
        if run is not None:
            refuse_taken(run, config)  # before the lock, which would leave its file in someone else's folder
            if ctx.main:
                run.lock()  # a second process writing this folder is refused here, naming it
                locked = run
                s.make_sound(run)
            old, ck = s.open_run(run)
            epochs = int(hp["epochs"])
            if ck is not None and int(ck["epoch"]) >= epochs and run.state == "finished":
                s.say(f"{run.path} finished all {epochs} epochs already")
                return result_from_checkpoint(ck, run, ctx, key)
        data = s.load_data()
        built = initialized_model(s.config, data, old if ck is not None else None, on_init if ctx.main else None, s.say)
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


# --------------------------------------------------------------------------- training

def _train_model(s: Session, data: Data, built: Initialized, ck: Optional[Dict[str, Any]], *,
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
    progress = Progress(best_on="val" if data.val is not None else "test")
    if ck is not None:
        s.restore(ck, built.model, sc, progress)
    if ctx.distributed:
        # Different augmentation/dropout draws per process, reproducible from the checkpointed state.
        torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,)).item()) + ctx.rank)
    from structinit.training.feed import Feed

    feed = Feed(s, data, sc.autocast)
    n_train, steps = len(data.train), feed.steps
    resolved = {"hparams": s.hp, "model": built.arch, "dataset": dataclasses.asdict(info), "params": params,
                "train_images": n_train, "val_images": len(data.val) if data.val is not None else 0,
                "steps_per_epoch": steps, "world_size": ctx.world, "device": ctx.device,
                "amp": amp_name(dtype)}
    writer = s.writer
    if writer is not None:
        s.write_start(writer, built, progress, resolved)
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
            s.save_epoch(writer, built, sc, progress, params, epoch + 1, improved)
        if on_epoch and ctx.main:
            on_epoch(record)
        dist_.barrier(ctx)
    result = s.result(progress, built, params)
    if writer is not None:
        writer.write_final(result.summary())
    return result


def _step_context(s: Session, model: torch.nn.Module) -> Tuple[StepContext, Optional[torch.dtype]]:
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


def _train_one_epoch(s: Session, sc: StepContext, feed: Feed, model: torch.nn.Module, progress: Progress, epoch: int,
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


def _now(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


__all__ = ["TrainConfig", "TrainResult", "TrainingStopped", "train", "train_epoch", "evaluate", "build_optimizer",
           "lr_at", "shard_batches", "epoch_permutation", "EXECUTION_FIELDS", "StepContext", "amp_dtype", "amp_name",
           "init_inputs", "FIDELITY_SAMPLES"]
