"""One pass of training and its parts: the schedule (:func:`lr_at`), the data order
(:func:`epoch_permutation`, :func:`shard_batches`), the optimizer (:func:`build_optimizer`), mixed
precision (:func:`amp_dtype`), one epoch (:func:`train_epoch`) and a model's sums on a split
(:func:`evaluate`). No run folder, no process group: :func:`structinit.training.loop.train` puts
them together, and the loop benchmark times them bare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

if TYPE_CHECKING:  # torch is imported where it is used
    import torch


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


