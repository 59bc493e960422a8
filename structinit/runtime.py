"""Where and how computation runs: the device (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and the
number of CPU threads torch uses. Every command takes these through the same two functions."""

from __future__ import annotations

from typing import Optional

from structinit.errors import UsageError, param

DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str) -> str:
    """``device`` if it is a known name (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else a :class:`UsageError`."""
    text = str(device)
    if text in DEVICES or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise UsageError(f"unknown {param('device')} {device!r}; choose auto, cpu, cuda or cuda:N")


def resolve_device(device: str = "auto", local_rank: int = 0) -> str:
    """``auto`` -> ``cuda:LOCAL_RANK`` (``cuda`` likewise) when a GPU is visible, else ``cpu``; an
    explicit CUDA device without a GPU is a :class:`UsageError`."""
    device = check_device(device)
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"{param('device')} {device} was asked for but no CUDA GPU is available")
    return f"cuda:{local_rank}" if device == "cuda" else device


def check_threads(threads: Optional[int]) -> Optional[int]:
    """``threads`` if ``None`` (torch's default) or a positive integer, else a :class:`UsageError`."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise UsageError(f"{param('threads')} must be at least 1, got {threads!r}")
    return threads


def set_threads(threads: Optional[int]) -> None:
    """Set torch's CPU threads (``None`` keeps torch's default). On a loaded or virtualized CPU one
    thread can be several times faster than two contended ones."""
    if check_threads(threads) is None:
        return
    import torch

    torch.set_num_threads(threads)
