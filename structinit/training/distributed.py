"""Process-group plumbing for running ``train`` under ``torchrun`` with no code change.

``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous variables; when they
are present :func:`setup` joins the group (NCCL on GPUs, gloo on CPU). Without them it is a
single process of world size 1 and every helper here is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistContext:
    """This process's place: ``rank`` of ``world`` (``local_rank`` on its node), its ``device``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str = ""

    @property
    def main(self) -> bool:
        """True on the one process that writes files and prints (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def planned_world() -> int:
    """The number of processes this run has: torchrun's ``WORLD_SIZE``, else 1 (known before any
    process group exists, so a setting the processes cannot share is refused by each of them before
    one waits on the others)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1


def setup(device: str = "auto") -> DistContext:
    """Pick the device (``auto``: ``cuda:LOCAL_RANK`` when a GPU is visible, else ``cpu``) and,
    under torchrun with ``WORLD_SIZE > 1``, initialize the default process group."""
    import torch

    world = planned_world()
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    from structinit.runtime import resolve_device

    device = resolve_device(device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = ""
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
    return DistContext(rank, world, local_rank, device, backend)


def teardown(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(ctx: DistContext, tensor):
    """Sum ``tensor`` over all processes in place (returns it)."""
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
