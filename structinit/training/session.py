"""One :func:`~structinit.training.loop.train` call's shared state (:class:`Session`) and its part
of the run: the run folder made sound, read and written (``config.json``, ``metrics.jsonl``, the
checkpoints, through :class:`~structinit.training.rundir.RunDir`), the data loaded, a checkpoint
restored, the result; and the stop vote of every process (:func:`stop_vote`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.training.config import TrainConfig
from structinit.training.result import Progress, TrainResult
from structinit.training.rundir import RunDir

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

    from structinit.training.datasets import Data
    from structinit.training.distributed import DistContext
    from structinit.training.init_at_start import Initialized
    from structinit.training.steps import StepContext


@dataclass
class Session:
    """What the steps of one :func:`~structinit.training.loop.train` call share: the config and its
    resolved hyperparameters ``hp``, the process group ``ctx``
    (:func:`structinit.training.distributed.setup`), the run folder (``None``: nothing is written),
    the run key, when the call started (``perf_counter``) and ``say`` (the ``log`` callback on rank
    0, else silent). Its methods are the run's steps that read or write the folder."""

    config: TrainConfig
    hp: Dict[str, Any]
    ctx: DistContext
    run: Optional[RunDir]
    key: str
    t_start: float
    say: Callable[[str], None]
    vote: Optional[Callable[[], bool]] = None  # ``stop`` as every process agrees on it (:func:`stop_vote`)
    found_versions: Optional[Dict[str, str]] = None  # what it trains under (:meth:`versions`), found once

    @property
    def writer(self) -> Optional[RunDir]:
        """The run folder when this process writes the run's files (rank 0 of a run with a folder), else ``None``."""
        return self.run if self.ctx.main else None

    @property
    def epochs(self) -> int:
        """The number of epochs the run trains for."""
        return int(self.hp["epochs"])

    def make_sound(self, run: RunDir) -> None:
        """On rank 0, with the lock held: refuse a folder another run took in the meantime; when
        resuming, set a damaged folder's files aside (saying where). ``run`` is ``self.run``."""
        refuse_taken(run, self.config)
        if self.config.resume:
            why = run.damage()
            aside = run.set_aside()
            if aside is not None:
                moved = ", ".join(sorted(p.name for p in aside.iterdir() if p.name != run.WHY))
                then = "resuming from its checkpoint" if run.file(run.CHECKPOINT).exists() else "training it afresh"
                self.say(f"{run.path} was damaged ({why}): moved {moved} into {aside}; {then}")

    def open_run(self, run: RunDir) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
        """``(config.json, checkpoint)`` of the run being resumed (``None`` each when there is none),
        read by every process once rank 0 has made the folder sound; resuming with settings that change
        what is computed is refused, naming them. ``run`` is ``self.run``."""
        from structinit.training import distributed as dist_

        config = self.config
        dist_.barrier(self.ctx)  # the other processes read the folder once rank 0 has made it sound
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

    def write_start(self, run: RunDir, built: Initialized, progress: Progress, resolved: Dict[str, Any]) -> None:
        """Rank 0 writes the run's ``config.json`` (settings, key, ``resolved`` setup, the init and its
        report) and ``metrics.jsonl`` as the checkpoint has it (the epoch-0 line is the init's, rebuilt),
        and drops a ``final.json`` the run will write anew. ``run`` is ``self.run``."""
        from structinit import __version__

        spec = self.config.init
        run.create()
        run.write_config({"config": self.config.to_dict(), "key": self.key, "resolved": resolved,
                          "init": spec.to_dict() if spec is not None else None, "init_report": built.report_json(),
                          "init_seconds": built.rounded_seconds,
                          "algorithms": spec.algorithms() if spec is not None else {},
                          "version": __version__, "versions": self.versions()})
        run.write_metrics(([built.record] if built.record else []) + progress.metrics)
        if progress.start_epoch < self.epochs:
            run.clear_final()

    def save_epoch(self, run: RunDir, built: Initialized, sc: StepContext, progress: Progress,
                   params: Dict[str, int], epoch: int, improved: bool) -> None:
        """Rank 0 saves ``checkpoint.pt`` into ``run`` (``self.run``) after ``epoch`` (1-based: the epochs
        done; everything a resume needs, RNG states included) and, when it ``improved`` on the best
        epoch, ``best.pt``."""
        import torch

        config, device = self.config, self.ctx.device
        # What apply/inspect cannot read off the weights (see structinit.init.checkpoints.SHAPE_KEY).
        shape = {"grid": list(built.arch["grid"]), "heads": built.arch.get("heads")}
        state = {"state_dict": built.model.state_dict(), "epoch": epoch, "arch": config.model.name, "shape": shape,
                 "args": config.to_dict(), "optimizer": sc.opt.state_dict(),
                 "scaler": sc.scaler.state_dict() if sc.scaler is not None else None, "metrics": progress.metrics,
                 "best_acc": progress.best_acc, "best_score": progress.best_score, "best_epoch": progress.best_epoch,
                 "best_on": progress.best_on, "elapsed": progress.elapsed(self.t_start), "params": params,
                 "key": self.key, "init_seconds": built.rounded_seconds, "versions": self.versions(),
                 "rng": {"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}}
        if improved:
            run.save_best({"state_dict": state["state_dict"], "epoch": epoch, "arch": config.model.name,
                           "shape": shape, "args": config.to_dict(), "test_acc": progress.best_acc,
                           "selected_on": progress.best_on})
        run.save_checkpoint(state)

    def load_data(self) -> Data:
        """The run's dataset with its training subset and validation split drawn (with ``download``
        under torchrun, rank 0 fetches while the others wait); refused when one global batch is larger
        than the training split."""
        from structinit.training import distributed as dist_
        from structinit.training.datasets import load_dataset, split_train

        config, ctx = self.config, self.ctx
        if config.download and ctx.distributed and not ctx.main:
            dist_.barrier(ctx)
        data = load_dataset(config.dataset, config.data_dir, download=config.download, image_size=config.image_size,
                            shuffle_seq=config.shuffle_seq)
        if config.download and ctx.distributed and ctx.main:
            dist_.barrier(ctx)
        data = split_train(data, config.train_size, config.val_size,
                           config.seed if config.data_seed is None else config.data_seed)
        gb, n_train = int(self.hp["batch_size"]), len(data.train)
        if n_train // gb < 1:
            raise UsageError(f"{param('batch_size')} {gb} is larger than the {n_train} training images")
        return data

    def restore(self, ck: Dict[str, Any], model: torch.nn.Module, sc: StepContext, progress: Progress) -> None:
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
        if self.ctx.device.startswith("cuda") and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"])
        assert self.run is not None  # a checkpoint is read from the run's folder
        self.say(f"resuming {self.run.path} after epoch {progress.start_epoch}/{self.epochs}")

    def result(self, progress: Progress, built: Initialized, params: Dict[str, int]) -> TrainResult:
        """The :class:`TrainResult` of a run that trained to its last epoch."""
        last = progress.metrics[-1] if progress.metrics else {}
        return TrainResult(final_acc=last.get("test_acc", float("nan")), final_val_acc=last.get("val_acc"),
                           best_acc=progress.best_acc, best_epoch=progress.best_epoch, best_on=progress.best_on,
                           epochs=len(progress.metrics), wall_seconds=progress.elapsed(self.t_start), params=params,
                           metrics=progress.metrics, out=str(self.run.path) if self.run is not None else None,
                           key=self.key, resumed_from=progress.resumed_from, world_size=self.ctx.world,
                           device=self.ctx.device, init_report=built.report_json(),
                           init_seconds=built.rounded_seconds, versions=self.versions())

    def versions(self) -> Dict[str, str]:
        """What this session trains under (:func:`structinit.runtime.software_versions`), found once."""
        if self.found_versions is None:
            from structinit.runtime import software_versions

            self.found_versions = software_versions(self.ctx.device)
        return self.found_versions


def refuse_taken(run: RunDir, config: TrainConfig) -> None:
    """A fresh run never writes into a folder that holds a run's files (whoever wrote them)."""
    if not config.resume and run.holds_run():
        names = (run.CONFIG, run.CHECKPOINT, run.BEST, run.FINAL, run.METRICS)
        found = [n for n in names if run.file(n).exists()]
        raise UsageError(f"{run.path} already holds a run ({', '.join(found)}); pass {param('resume')} to "
                         f"continue it or choose another {param('out')}")



def stop_vote(ctx: DistContext, stop: Callable[[], bool]) -> Callable[[], bool]:
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

