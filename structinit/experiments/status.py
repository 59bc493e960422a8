"""Where the runs of a grid stand: ``finished`` (a ``final.json`` that checks out against the run's
config and checkpoint), ``running`` (a task that holds the run's lock; where the lock cannot be
probed, a heartbeat younger than :data:`STALE_SECONDS` or a fresh checkpoint), ``failed`` (the last
task ended with an error; its last log line says which),
``damaged`` (files that do not check out: a ``final.json`` that does not parse or belongs to another
run, a checkpoint that cannot be read; see :meth:`~structinit.training.rundir.RunDir.damage`; a
rerun sets them aside and trains the run) or ``pending`` (not started, or stopped with a checkpoint
to resume from). Reading the status touches no run and imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from structinit.experiments.expand import Cell, Expansion
from structinit.training.rundir import RunDir

STATES = ("finished", "running", "failed", "damaged", "pending")
#: A heartbeat older than this (seconds) is a task that is gone.
STALE_SECONDS = 120.0
#: A checkpoint younger than this (or than three epochs of the run) counts as a running run
#: started by hand (e.g. a printed command) that writes no heartbeat.
FRESH_CHECKPOINT_SECONDS = 600.0


@dataclass
class RunStatus:
    """One run: ``state`` (one of :data:`STATES`), ``epochs_done``, whether it has a checkpoint to
    resume from, and ``detail``: the error of a failed run, the age of a running one."""

    key: str
    path: str
    state: str
    epochs_done: int = 0
    resumable: bool = False
    detail: Optional[str] = None


def run_status(run: Path, now: Optional[float] = None) -> RunStatus:
    """The state of the run in folder ``run`` (see the module docstring)."""
    now = time.time() if now is None else now
    run = Path(run)
    rd = RunDir(run)
    key = run.name
    beat = rd.age(rd.HEARTBEAT, now)
    task = rd.read_task() or {}
    held = rd.lock_held()  # a task killed outright leaves its lock free at once, its heartbeat for minutes
    alive = held if held is not None else beat is not None and beat < STALE_SECONDS
    running = task.get("state") == "running" and alive
    resumable = rd.file(rd.CHECKPOINT).is_file()
    finished = rd.file(rd.FINAL).is_file()
    if not running and (finished or resumable):
        why = rd.damage()
        if why is not None:
            return RunStatus(key, str(run), "damaged", rd.epochs_recorded(), False, why)
    done = rd.epochs_recorded()
    if finished:
        return RunStatus(key, str(run), "finished", done)
    if running:
        since = f"heartbeat {beat:.0f}s ago" if beat is not None else "no heartbeat yet"
        return RunStatus(key, str(run), "running", done, resumable, f"{since} on {task.get('host')}")
    ck_age = rd.age(rd.CHECKPOINT, now) if resumable else None
    if (ck_age is not None and (task.get("state") in (None, "running")) and ck_age < FRESH_CHECKPOINT_SECONDS
            and held is not False):
        return RunStatus(key, str(run), "running", done, resumable, f"checkpoint written {ck_age:.0f}s ago")
    if task.get("state") == "failed":
        return RunStatus(key, str(run), "failed", done, resumable, task.get("error") or rd.last_log_line())
    return RunStatus(key, str(run), "pending", done, resumable,
                     f"checkpoint after epoch {done}" if resumable else None)


@dataclass
class GridStatus:
    """Counts per state and every run's :class:`RunStatus` (with its cell), for one expansion."""

    name: str
    runs_dir: str
    counts: Dict[str, int]
    runs: List[Dict[str, Any]]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> Dict[str, Any]:
        return {"grid": self.name, "runs_dir": self.runs_dir, "total": self.total, "counts": self.counts,
                "runs": self.runs}


def grid_status(ex: Expansion, now: Optional[float] = None) -> GridStatus:
    """The status of every distinct run of ``ex``."""
    now = time.time() if now is None else now
    counts = {s: 0 for s in STATES}
    runs = []
    cells: List[Cell] = ex.unique_cells()
    for cell in cells:
        st = run_status(ex.run_dir(cell), now)
        counts[st.state] += 1
        runs.append(dict(asdict(st), cell=ex.describe(cell), row=cell.row, column=list(cell.column), seed=cell.seed))
    return GridStatus(ex.spec.name, str(ex.runs_dir), counts, runs)


def status_text(st: GridStatus, limit: int = 20) -> str:
    """A few lines for people: the counts, then the failed runs with their last log line and the
    running ones (at most ``limit`` of each)."""
    c = st.counts
    resumable = sum(1 for r in st.runs if r["state"] == "pending" and r["resumable"])
    runs = f"{st.total} run{'' if st.total == 1 else 's'}"
    lines = [f"grid {st.name}: {runs} in {st.runs_dir}: {c['finished']} finished, {c['running']} running, "
             f"{c['failed']} failed, " + (f"{c['damaged']} damaged, " if c.get("damaged") else "")
             + f"{c['pending']} pending" + (f" ({resumable} with a checkpoint)" if resumable else "")]
    for state in ("failed", "damaged", "running"):
        chosen = [r for r in st.runs if r["state"] == state]
        if chosen:
            lines.append(f"{state}:")
            for r in chosen[:limit]:
                lines.append(f"  {r['path']}  {r['cell']}, {r['epochs_done']} epoch(s) done: {r['detail'] or ''}")
            if len(chosen) > limit:
                lines.append(f"  ... and {len(chosen) - limit} more")
    return "\n".join(lines)


__all__ = ["RunStatus", "GridStatus", "run_status", "grid_status", "status_text", "STATES"]
