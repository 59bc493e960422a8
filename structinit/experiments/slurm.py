"""The SLURM launcher: a grid's pending runs as one job array (one task per run), written from the
template ``structinit/experiments/templates/slurm_array.sbatch`` into ``RUNS/slurm/<grid>-<time>/``
(``job.sbatch``, ``tasks.txt``, ``logs/<array job>_<task>.log``) and submitted with ``sbatch``.

Each task runs ``structinit bench run RUN`` as a job step (``srun``): it skips a finished run,
resumes an interrupted one, and on ``USR2`` (``--signal=USR2@SECONDS``, sent before the time limit
and on preemption) stops after its last checkpoint and requeues itself, the conventions of
submitit. Multi-GPU tasks (``gpus > 1``) train under ``torchrun`` with one process per GPU.

Example::

    job = write_job(ex, cells, SlurmOptions(partition="gpu", time="12:00:00", gpus=1, cpus=8))
    job_id = submit(job)            # or print job.script for a dry run
"""

from __future__ import annotations

import datetime
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Dict, List, Optional, Sequence, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.experiments.expand import Cell, Expansion

TEMPLATE = "slurm_array.sbatch"
TIME_RE = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}\Z|\d+-\d+\Z")
MEM_RE = re.compile(r"\d+[KMGTkmgt]?\Z")
#: #SBATCH options the launcher writes itself (short and long names -> the long one).
OWN_OPTIONS = {"array": "array", "a": "array", "output": "output", "o": "output", "signal": "signal",
               "open-mode": "open-mode"}


def check_time(text: str) -> str:
    """A SLURM time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, each field in
    range (a :class:`UsageError` naming ``time`` otherwise)."""
    def bad(why: str = "") -> UsageError:
        return UsageError(f"{param('time')} must look like HH:MM:SS, D-HH:MM:SS or minutes{why}, got {text!r}")

    if not TIME_RE.match(text):
        raise bad()
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    limits: Sequence[Tuple[str, Optional[int]]]  # each field's name and bound (None: any)
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        limits = [("hours", 24), ("minutes", 60), ("seconds", 60)][:len(parts)]
    else:  # MM, MM:SS, HH:MM:SS
        by_fields: Dict[int, Sequence[Tuple[str, Optional[int]]]] = {
            1: [("minutes", None)], 2: [("minutes", None), ("seconds", 60)],
            3: [("hours", None), ("minutes", 60), ("seconds", 60)]}
        limits = by_fields[len(parts)]
    for value, (what, top) in zip(parts, limits):
        if top is not None and value >= top:
            raise bad(f" ({what} below {top})")
    return text


class _Template(Template):
    delimiter = "%%"


@dataclass
class SlurmOptions:
    """What each array task asks SLURM for. ``gpus``: GPUs per task (``--gres=gpu:N``; more than
    one trains under torchrun); ``cpus``: CPUs per task; ``time``: the limit (``HH:MM:SS``,
    ``D-HH:MM:SS`` or minutes); ``max_concurrent``: at most this many tasks at once (``%K``);
    ``extra``: more ``#SBATCH`` lines (e.g. ``--constraint=a100``); ``signal_seconds``: how long
    before the limit USR2 is sent."""

    partition: Optional[str] = None
    time: Optional[str] = None
    gpus: int = 0
    cpus: Optional[int] = None
    mem: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    extra: Sequence[str] = field(default_factory=list)
    max_concurrent: Optional[int] = None
    signal_seconds: int = 120
    job_name: Optional[str] = None

    def validate(self) -> None:
        for name, lowest in (("gpus", 0), ("cpus", 1), ("max_concurrent", 1), ("signal_seconds", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise UsageError(f"{param(name)} must be an integer of at least {lowest}, got {value!r}")
        if self.time is not None:
            check_time(str(self.time))
        for name in ("partition", "mem", "account", "qos", "job_name"):
            value = getattr(self, name)
            if value is not None and (not str(value).strip() or any(c.isspace() for c in str(value))):
                raise UsageError(f"{param(name)} must be one word, got {value!r}")
        if self.mem is not None and not MEM_RE.match(str(self.mem)):
            raise UsageError(f"{param('mem')} must be a size in megabytes or with a unit K, M, G or T (32G, 4000M), "
                             f"got {self.mem!r}")
        for line in self.extra:
            if "\n" in line or not line.strip():
                raise UsageError(f"{param('sbatch')} takes one #SBATCH option per use, got {line!r}")
            text = line.strip()
            text = text[len("#SBATCH"):].strip() if text.startswith("#SBATCH") else text
            if not re.match(r"--?[A-Za-z]", text):
                raise UsageError(f"{param('sbatch')} takes an sbatch option such as --constraint=a100 (one that "
                                 f"starts with -), got {line!r}")
            named = re.match(r"--?([A-Za-z-]+)", text)
            assert named is not None  # text starts as the check above asks
            name = named.group(1)
            if name in OWN_OPTIONS:
                raise UsageError(f"{param('sbatch')} {text}: the launcher writes --{OWN_OPTIONS[name]} itself (one "
                                 "array task per run, its log, the stop signal); edit the written script to change it")

    def sbatch_lines(self, count: int, log_dir: Path, job_name: str) -> List[str]:
        array = f"0-{count - 1}" + (f"%{self.max_concurrent}" if self.max_concurrent else "")
        lines = [f"--job-name={self.job_name or job_name}", f"--array={array}",
                 f"--output={log_dir}/%A_%a.log", "--open-mode=append", f"--signal=USR2@{self.signal_seconds}",
                 "--requeue", "--nodes=1", "--ntasks=1"]
        if self.cpus:
            lines.append(f"--cpus-per-task={self.cpus}")
        if self.gpus:
            lines.append(f"--gres=gpu:{self.gpus}")
        for name, flag in (("partition", "partition"), ("time", "time"), ("mem", "mem"), ("account", "account"),
                           ("qos", "qos")):
            if getattr(self, name):
                lines.append(f"--{flag}={getattr(self, name)}")
        for line in self.extra:
            text = line.strip()
            text = text[len("#SBATCH"):].strip() if text.startswith("#SBATCH") else text
            lines.append(text)
        return ["#SBATCH " + ln for ln in lines]


@dataclass
class SlurmJob:
    """A written job: its folder, script, task list and size; ``job_id`` once submitted."""

    folder: Path
    script: Path
    tasks: Path
    count: int
    job_id: Optional[str] = None


def check_sbatch() -> str:
    """The path of ``sbatch`` (a :class:`UsageError` when it is not on PATH)."""
    path = shutil.which("sbatch")
    if path is None:
        raise UsageError("sbatch is not on PATH, so the job cannot be submitted here; run on a SLURM login node, "
                         f"pass {param('dry_run')} to write the job script only, or use {param('launcher')} local "
                         "or print")
    return path


def render_script(ex: Expansion, count: int, options: SlurmOptions, folder: Path, command: Optional[str]) -> str:
    """The job script's text (the template filled in)."""
    from importlib.resources import files

    from structinit import __version__
    from structinit.solver.cache import user_cache_dir

    text = (files("structinit.experiments") / "templates" / TEMPLATE).read_text(encoding="utf-8")
    nproc = max(1, options.gpus)
    values = dict(grid=ex.spec.name, count=count, version=__version__, command=command or "(library call)",
                  date=datetime.datetime.now().isoformat(timespec="seconds"), runs_dir=ex.runs_dir.absolute(),
                  signal_seconds=options.signal_seconds, script=folder / "job.sbatch",
                  tasks=shlex.quote(str(folder / "tasks.txt")), cache=shlex.quote(str(user_cache_dir().absolute())),
                  nproc=nproc, python=shlex.quote(sys.executable),
                  sbatch_lines="\n".join(options.sbatch_lines(count, folder / "logs", f"si-{ex.spec.name}")))
    return _Template(text).substitute(values)


def write_job(ex: Expansion, cells: List[Cell], options: SlurmOptions, command: Optional[str] = None) -> SlurmJob:
    """Write ``job.sbatch`` and ``tasks.txt`` for ``cells`` into a new folder under
    ``RUNS/slurm/`` (nothing is left behind if writing fails)."""
    from structinit.atomic import atomic_write

    options.validate()
    if not cells:
        raise UsageError("no runs to submit")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = ex.runs_dir.absolute() / "slurm"
    folder = base / f"{ex.spec.name}-{stamp}"
    k = 1
    while folder.exists():
        k += 1
        folder = base / f"{ex.spec.name}-{stamp}-{k}"
    try:
        (folder / "logs").mkdir(parents=True)
        tasks = folder / "tasks.txt"
        with atomic_write(tasks, "w") as f:
            f.write("".join(f"{ex.run_dir(c).absolute()}\n" for c in cells))
        script = folder / "job.sbatch"
        with atomic_write(script, "w") as f:
            f.write(render_script(ex, len(cells), options, folder, command))
        script.chmod(0o755)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise StructinitError(f"cannot write the job into {folder}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return SlurmJob(folder, script, tasks, len(cells))


def submit(job: SlurmJob) -> str:
    """Submit ``job`` with ``sbatch --parsable``; returns the job id. If SLURM refuses it, the job's
    folder is removed and the scheduler's message is the error."""
    from structinit.atomic import write_text

    sbatch = check_sbatch()
    try:
        r = subprocess.run([sbatch, "--parsable", str(job.script)], capture_output=True, text=True, timeout=120,
                           cwd=str(job.folder))
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(job.folder, ignore_errors=True)
        raise StructinitError(f"sbatch could not be run: {exc}") from None
    if r.returncode != 0:
        shutil.rmtree(job.folder, ignore_errors=True)
        message = " ".join((r.stderr or r.stdout or f"exit code {r.returncode}").split())
        raise StructinitError(f"SLURM refused the job: {message}")
    job.job_id = r.stdout.strip().split(";")[0]
    try:
        write_text(job.folder / "job_id", job.job_id + "\n")
    except OSError:
        pass
    return job.job_id


__all__ = ["SlurmOptions", "SlurmJob", "write_job", "submit", "render_script", "check_sbatch"]
