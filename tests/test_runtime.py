"""The CPU thread policy: what ``--threads`` defaults to on busy, idle, shared and quota'd machines."""

import os

import pytest

from structinit import runtime


@pytest.fixture
def machine(monkeypatch):
    """Pretend to be a machine with ``cpus`` cores of which ``busy`` are used by other processes."""

    def set_(cpus, busy, quota=None, env=None):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(runtime, "cpu_set", lambda: list(range(cpus)))
        monkeypatch.setattr(runtime, "busy_cores", lambda c, seconds=0.1: float(busy))
        monkeypatch.setattr(runtime, "cgroup_cpu_limit", lambda: quota)
        return runtime.default_threads()

    return set_


def test_the_default_leaves_a_core_free_and_never_oversubscribes(machine):
    assert machine(2, 0) == 1  # a small machine: one thread
    assert machine(2, 1.7) == 1 and machine(2, 2) == 1  # a busy one too
    assert machine(16, 0) == 15 and machine(16, 4.1) == 11 and machine(16, 16) == 1
    assert machine(16, 0, quota=4.0) == 3  # a cgroup quota of 4 cores
    assert machine(16, 0, env={"LOCAL_WORLD_SIZE": "4"}) == 3  # four torchrun processes share the node
    assert machine(16, 0, env={"OMP_NUM_THREADS": "6"}) == 6  # the user's own setting wins


def test_busy_cores_reads_the_real_machine():
    cpus = runtime.cpu_set()
    busy = runtime.busy_cores(cpus, seconds=0.05)
    assert 0.0 <= busy <= len(cpus) + 1e-9
    assert 1 <= runtime.default_threads() <= max(len(cpus), int(os.environ.get("OMP_NUM_THREADS", "1")))


def test_use_threads_sets_torch_or_the_environment(monkeypatch):
    import torch

    old = torch.get_num_threads()
    try:
        assert runtime.use_threads(1) == 1 and torch.get_num_threads() == 1
        with pytest.raises(Exception, match="threads must be at least 1"):
            runtime.use_threads(0)
    finally:
        torch.set_num_threads(old)
