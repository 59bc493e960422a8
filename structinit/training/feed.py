"""The data of one run on its device (:class:`Feed`): this process's share of an epoch's training
batches, and a model's loss and accuracy on a split over every process. Data read from disk goes
through DataLoaders whose workers leave the scheduler's stop signals to the process that trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, Tuple

from structinit.training.steps import evaluate, shard_batches

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

    from structinit.training.datasets import Data
    from structinit.training.session import Session


class Feed:
    """The data of one run on its device: :meth:`batches` gives this process's share of an epoch's
    training batches (augmented, then normalized), :meth:`evaluate` a model's loss and accuracy on a
    split (over every process). Data held in memory is moved to the device once; data read from disk
    goes through DataLoaders with the run's ``workers``."""

    def __init__(self, s: Session, data: Data, autocast: Callable[[], Any]) -> None:
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

