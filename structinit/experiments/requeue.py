"""A task asking SLURM to requeue it (``scontrol requeue``, only this task of an array), and the
SLURM job it runs in.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from structinit.experiments.stopping import STOP_SIGNALS, restore_mask, signal_mask


def slurm_job() -> Optional[Dict[str, Any]]:
    """The SLURM job this process runs in (``None`` outside SLURM)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    env = os.environ
    return {"job_id": env.get("SLURM_JOB_ID"), "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": env.get("SLURM_ARRAY_TASK_ID"), "restart": int(env.get("SLURM_RESTART_COUNT", "0"))}


def slurm_requeue_target(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The name ``scontrol requeue`` takes for this job: ``ARRAYJOB_TASK`` for an array task (one
    task's own job id is the array's id, and ``scontrol`` reads that as every task of the array),
    else ``SLURM_JOB_ID``; ``None`` outside SLURM. ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    array, index = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and index:
        return f"{array}_{index}"
    return env.get("SLURM_JOB_ID") or None


#: What ``scontrol requeue`` says when trying again cannot help (the job may not be requeued, or
#: is not this job); anything else (a controller too busy to answer in time) is tried again.
REQUEUE_REFUSALS = ("disabled", "invalid job id", "access", "permission", "not supported", "only")


def requeue_self(log: Callable[[str], None], attempts: int = 3, pause: float = 2.0) -> bool:
    """Ask SLURM to requeue this job, and only this task of an array (``scontrol requeue``
    :func:`slurm_requeue_target`); ``False`` if it cannot. A failure SLURM may get over (a busy
    controller's time-out) is tried again, ``attempts`` times in all, ``pause`` seconds apart
    (then twice that); a job already requeued (by the scheduler, as a preemption does) counts as
    requeued. Call it once the run's state is saved: SLURM ends the job's processes (SIGTERM, then
    SIGKILL) as it requeues it."""
    job = slurm_requeue_target()
    if not job:
        log("not under SLURM: cannot requeue; run the task again to resume")
        return False
    why = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(pause * attempt)
        try:
            r = _shielded(["scontrol", "requeue", job], timeout=30)
        except FileNotFoundError as exc:
            log(f"scontrol requeue {job} failed: {exc}")
            return False
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
            continue
        if r.returncode == 0:
            log(f"requeued SLURM job {job}; the run resumes from its checkpoint when the task starts again")
            return True
        why = " ".join((r.stderr or r.stdout or f"exit code {r.returncode}").split())
        if "pending" in why.lower():  # ESLURM_JOB_PENDING: requeued already
            log(f"SLURM job {job} is requeued already ({why}); the run resumes from its checkpoint when the task "
                "starts again")
            return True
        if any(word in why.lower() for word in REQUEUE_REFUSALS):
            break
    log(f"scontrol requeue {job} failed: {why}")
    return False


def _shielded(cmd: List[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` (its output captured, as text) with SIGTERM and SIGUSR2 blocked: the SIGTERM
    with which SLURM ends a job it requeues must not end the ``scontrol`` that asked for it before
    it has the answer."""
    mask = signal_mask("SIG_BLOCK", STOP_SIGNALS)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        restore_mask(mask)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

