"""Where and how computation runs: the device (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and the
number of CPU threads torch uses. Every command takes these through the same functions.

Threads. torch's default is one thread per core. On a small or shared machine that is the worst
choice: OpenMP threads wait for each other at every operation, so when another process holds one
of the cores every small operation waits for a time slice, and a run with two threads on two
cores, one of them busy, was measured 7-14 times slower than with one thread. The default here
(:func:`default_threads`, what every command uses unless given ``--threads``) is:

- ``OMP_NUM_THREADS`` when it is set (the user's choice);
- else the cores of this process's CPU set (its affinity mask, capped by a cgroup CPU quota) that
  are idle in a 0.1 s sample of ``/proc/stat`` (the load average where there is none), less one
  core of headroom for whatever starts next, shared out among the processes of a ``torchrun``
  node; at least 1.

So a busy or 2-core machine gets 1 thread, an idle 16-core one 15, and four ``torchrun``
processes on it 3 each. ``--threads N`` sets it exactly.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict, List, Optional

from structinit.errors import UsageError, param

DEVICES = ("auto", "cpu", "cuda")
#: Seconds the CPU use of the machine is sampled for when choosing the number of threads.
SAMPLE_SECONDS = 0.1


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


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; the CPU has no queue), so that a
    timer read next counts that work."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def device_name(device) -> str:
    """The name a report gives ``device``: the CUDA card's (``NVIDIA H100 80GB HBM3``, say), else ``cpu``."""
    if str(device).startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(device))
    return "cpu"


def check_threads(threads: Optional[int]) -> Optional[int]:
    """``threads`` if ``None`` (the default policy) or a positive integer, else a :class:`UsageError`."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise UsageError(f"{param('threads')} must be at least 1, got {threads!r}")
    return threads


# --------------------------------------------------------------------------- the thread policy

def cpu_set() -> List[int]:
    """The CPUs this process may run on (its affinity mask; all of them where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit() -> Optional[float]:
    """The cores a cgroup CPU quota allows (v2 ``cpu.max`` or v1 ``cfs_quota_us``), or ``None``."""
    for path, parse in (("/sys/fs/cgroup/cpu.max", lambda t: t.split()),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", lambda t: [t.strip(), _read(
                            "/sys/fs/cgroup/cpu/cpu.cfs_period_us") or "100000"])):
        text = _read(path)
        if not text:
            continue
        try:
            quota, period = parse(text)[:2]
            if quota in ("max", "-1"):
                return None
            return max(float(quota) / float(period), 1.0)
        except (ValueError, ZeroDivisionError, TypeError):
            return None
    return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _cpu_times() -> Dict[int, tuple]:
    """``{cpu: (busy, total)}`` jiffies from ``/proc/stat`` (empty where there is none)."""
    text = _read("/proc/stat") or ""
    out = {}
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *fields = line.split()
            values = [int(v) for v in fields[:8]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(values) - idle, sum(values))
    return out


def busy_cores(cpus: List[int], seconds: float = SAMPLE_SECONDS) -> float:
    """How many of ``cpus`` other processes keep busy: their busy share summed over a ``seconds``
    sample of ``/proc/stat`` (this process sleeps meanwhile), or, where there is no
    ``/proc/stat``, the 1-minute load average scaled to the share of the machine in ``cpus``."""
    before = _cpu_times()
    if before:
        time.sleep(seconds)
        after = _cpu_times()
        busy = 0.0
        for c in cpus:
            if c in before and c in after:
                d_busy, d_total = after[c][0] - before[c][0], after[c][1] - before[c][1]
                busy += d_busy / d_total if d_total > 0 else 0.0
        return busy
    try:
        return os.getloadavg()[0] * len(cpus) / max(os.cpu_count() or 1, 1)
    except (AttributeError, OSError):
        return 0.0


def local_processes() -> int:
    """Processes of this job on this machine (``torchrun``'s ``LOCAL_WORLD_SIZE``; 1 otherwise)."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def default_threads() -> int:
    """The number of torch CPU threads to use when none is given (see the module docstring)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = cpu_set()
    cores = float(len(cpus))
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, limit)
    idle = max(cores - busy_cores(cpus), 0.0)
    return max(1, math.floor((idle + 0.25 - 1) / local_processes()))


def set_threads(threads: Optional[int]) -> None:
    """Set torch's CPU threads to ``threads`` (``None`` leaves torch as it is: what the library does
    unless asked; the commands call :func:`use_threads`)."""
    threads = check_threads(threads)
    if threads is None:
        return
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def use_threads(threads: Optional[int] = None) -> int:
    """What every command calls first: ``threads``, or :func:`default_threads` when ``None``, for
    torch (and the BLAS of NumPy) in this process. Before torch is imported it is set through
    ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, so the command does not import torch for it. Returns
    the number."""
    n = check_threads(threads) or default_threads()
    if "torch" in sys.modules:
        set_threads(n)
    else:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(n)
    return n


#: What :func:`software_versions` records, in this order (``transformers`` only where it is imported).
VERSION_FIELDS = ("python", "torch", "timm", "numpy", "transformers", "structinit", "platform", "device")


def software_versions(device: str = "cpu") -> Dict[str, str]:
    """What a computation runs under, to record beside its results (never in a key: the same
    settings are the same run): the versions of Python, torch, timm, numpy (and transformers when
    this process imported it) and structinit, the platform (``platform.platform()``) and the
    device's name (:func:`device_name`). The same key on another install can give another number
    in the last digits (floating-point kernels change between versions); this record is how a
    report tells. Imports torch, timm and numpy."""
    import platform

    import numpy
    import timm
    import torch

    from structinit import __version__

    found = {"python": platform.python_version(), "torch": str(torch.__version__), "timm": str(timm.__version__),
             "numpy": str(numpy.__version__), "structinit": __version__, "platform": platform.platform(),
             "device": device_name(device)}
    if "transformers" in sys.modules:
        found["transformers"] = str(getattr(sys.modules["transformers"], "__version__", "unknown"))
    return {k: found[k] for k in VERSION_FIELDS if k in found}


def versions_text(versions: Dict[str, str]) -> str:
    """A record of :func:`software_versions` in one line: ``python=3.11.2 torch=2.5.1 ...`` (the
    form of runs.csv's ``versions`` column; :func:`parse_versions` reads it back)."""
    return " ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in versions.items())


def parse_versions(text: str) -> Dict[str, str]:
    """:func:`versions_text` read back (``{}`` for an empty text; words without ``=`` are skipped)."""
    pairs = (w.split("=", 1) for w in str(text).split() if "=" in w)
    return {k: v for k, v in pairs}


def duration_text(seconds: float) -> str:
    """``42 s``, ``12 minutes``, ``3.5 hours``, ``2.1 days``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"
