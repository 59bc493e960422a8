"""What a run gives back: :class:`TrainResult` (``final.json``), :class:`TrainingStopped` (a run
asked to stop), :class:`Progress` (where a run stands between epochs) and the result of a finished
run read from its checkpoint (:func:`result_from_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from structinit.training.distributed import DistContext
    from structinit.training.rundir import RunDir


class TrainingStopped(Exception):
    """Raised by :func:`~structinit.training.loop.train` when its ``stop`` asked it to stop: every
    process stopped after the same optimizer step (or before an epoch). ``epochs_done``: the epochs
    in the run's checkpoint (0: none; a run folder then keeps nothing of this run)."""

    def __init__(self, epochs_done: int):
        super().__init__(f"stopped after {epochs_done} epoch(s)")
        self.epochs_done = epochs_done


@dataclass
class TrainResult:
    """What :func:`~structinit.training.loop.train` returns (its :meth:`summary` is ``final.json``). Accuracies in %.

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


@dataclass
class Progress:
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


def result_from_checkpoint(ck: Dict[str, Any], run: RunDir, ctx: DistContext, key: str) -> TrainResult:
    """The result of a finished run, from its last checkpoint (which holds every epoch's record),
    as :func:`~structinit.training.loop.train` returned it (``final.json`` is not read: the
    checkpoint is the record)."""
    metrics = list(ck["metrics"])
    return TrainResult(final_acc=metrics[-1]["test_acc"], final_val_acc=metrics[-1].get("val_acc"),
                       best_acc=float(ck["best_acc"]),
                       best_epoch=int(ck["best_epoch"]), best_on=ck["best_on"], epochs=len(metrics),
                       wall_seconds=float(ck["elapsed"]), params=dict(ck["params"]),
                       metrics=metrics, out=str(run.path), key=key, resumed_from=int(ck["epoch"]),
                       world_size=ctx.world, device=ctx.device, init_seconds=ck.get("init_seconds"),
                       versions=ck.get("versions"))

