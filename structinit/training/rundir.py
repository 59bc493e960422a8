"""A training run's directory and its files.

=================  =============================================================================
``config.json``    the settings as given and as resolved, the run key, the init report
``metrics.jsonl``  one JSON record per finished epoch
``checkpoint.pt``  everything needed to resume (timm's ``{'state_dict', 'epoch', 'arch', 'args'}``
                   layout plus optimizer, RNG and metrics), written atomically after every epoch
``best.pt``        the weights of the best epoch on the validation split (on the test split when
                   there is none; labelled so in ``final.json``)
``final.json``     the result: final-epoch accuracy first, the best epoch labelled as such
=================  =============================================================================

A run is *fresh* (no checkpoint), *resumable* (a checkpoint, no ``final.json``) or *finished*.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from structinit.atomic import atomic_write
from structinit.errors import StructinitError, UsageError, param

CHECKPOINT_FORMAT = "structinit-train/1"
STATES = ("fresh", "resumable", "finished")


class RunDir:
    """The run directory at ``path`` (it need not exist yet)."""

    CONFIG, METRICS, CHECKPOINT, BEST, FINAL = "config.json", "metrics.jsonl", "checkpoint.pt", "best.pt", "final.json"

    def __init__(self, path: os.PathLike):
        if str(path).strip() == "":
            raise UsageError(f"{param('out')} needs a folder name")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"{param('out')} {self.path} exists and is not a directory")
        self.created: List[Path] = []  # folders create() made, outermost first
        self.opened = False  # create() was called and nothing discarded since: the files here are this run's

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def state(self) -> str:
        """``fresh``, ``resumable`` or ``finished`` (see the module docstring)."""
        if self.file(self.FINAL).is_file():
            return "finished"
        return "resumable" if self.file(self.CHECKPOINT).is_file() else "fresh"

    def holds_run(self) -> bool:
        """Whether anything a run writes is here (its config, a checkpoint, metrics or a result):
        a fresh run never replaces such a file, whoever wrote it."""
        return any(self.file(n).exists() for n in (self.CONFIG, self.CHECKPOINT, self.BEST, self.FINAL, self.METRICS))

    def create(self) -> None:
        missing = [p for p in [self.path, *self.path.parents] if not p.exists()][::-1]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StructinitError(f"cannot create run folder {self.path}: {exc.strerror or exc}") from None
        self.created, self.opened = missing, True

    def discard_unstarted(self) -> None:
        """After a failure before the first checkpoint: remove what this run wrote (``config.json``,
        ``metrics.jsonl``, ``best.pt``) and the folders it created, so no half-made run is left
        behind. A folder holding anything else is kept. Done once: what is written here afterwards is
        not this run's."""
        if not self.opened or self.file(self.CHECKPOINT).exists():
            return
        for name in (self.CONFIG, self.METRICS, self.BEST):
            try:
                self.file(name).unlink()
            except OSError:  # not there, or not removable: nothing of it to undo
                pass
        for folder in reversed(self.created):
            try:
                folder.rmdir()  # only if empty
            except OSError:
                break
        self.opened = False

    # ---- JSON files
    def _write_text(self, name: str, text: str) -> None:
        try:
            with atomic_write(self.file(name), "w") as f:
                f.write(text)
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(name)}: {exc.strerror or exc}") from None

    def _read_json(self, name: str) -> Optional[Dict[str, Any]]:
        path = self.file(name)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StructinitError(f"{path} is unreadable ({exc})") from None

    def write_config(self, doc: Dict[str, Any]) -> None:
        self._write_text(self.CONFIG, json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")

    def read_config(self) -> Optional[Dict[str, Any]]:
        return self._read_json(self.CONFIG)

    def write_final(self, summary: Dict[str, Any]) -> None:
        self._write_text(self.FINAL, json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def read_final(self) -> Optional[Dict[str, Any]]:
        return self._read_json(self.FINAL)

    def clear_final(self) -> None:
        self.file(self.FINAL).unlink(missing_ok=True)

    # ---- metrics
    def read_metrics(self) -> List[Dict[str, Any]]:
        """The epoch records of ``metrics.jsonl``, epochs 1 on (the init's epoch-0 line and a torn
        last line are left out)."""
        path = self.file(self.METRICS)
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return [r for r in rows if not (isinstance(r, dict) and r.get("epoch") == 0)]

    def write_metrics(self, rows: List[Dict[str, Any]]) -> None:
        self._write_text(self.METRICS, "".join(json.dumps(m, sort_keys=True) + "\n" for m in rows))

    def append_metrics(self, record: Dict[str, Any]) -> None:
        try:
            with open(self.file(self.METRICS), "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(self.METRICS)}: {exc.strerror or exc}") from None

    # ---- checkpoints
    def _save(self, obj: Any, name: str) -> None:
        from structinit.atomic import save_torch

        try:
            save_torch(obj, self.file(name))
        except OSError as exc:
            raise StructinitError(f"cannot write {self.file(name)}: {exc.strerror or exc}") from None

    def save_checkpoint(self, state: Dict[str, Any]) -> None:
        self._save(dict(state, format=CHECKPOINT_FORMAT), self.CHECKPOINT)

    def save_best(self, state: Dict[str, Any]) -> None:
        self._save(state, self.BEST)

    def load_checkpoint(self, map_location="cpu") -> Dict[str, Any]:
        """``checkpoint.pt`` (read with ``weights_only=True``)."""
        return load_train_checkpoint(self.file(self.CHECKPOINT), map_location)


def _read_torch(path: os.PathLike, map_location) -> Any:
    """``torch.load(path, weights_only=True)``; every failure is one :class:`StructinitError` line."""
    import torch

    from structinit.init.checkpoints import sniff_format

    try:
        if sniff_format(path) == "torch":
            return torch.load(path, map_location=map_location, weights_only=True)
        why = "not a torch checkpoint, or truncated"  # its first bytes are neither a torch.save zip nor a pickle
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
        why = _unreadable(exc)
    raise StructinitError(f"cannot read checkpoint {path}: {why}")


def load_train_checkpoint(path: os.PathLike, map_location="cpu") -> Dict[str, Any]:
    """A ``checkpoint.pt`` written by :func:`structinit.train` (read with ``weights_only=True``)."""
    ck = _read_torch(path, map_location)
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise StructinitError(f"{path} is not a structinit training checkpoint")
    return ck


def load_run_weights(path: os.PathLike, map_location="cpu") -> Dict[str, Any]:
    """The weights a training run wrote: its ``checkpoint.pt`` (the last finished epoch) or
    ``best.pt`` (the best one), each holding ``state_dict``, ``epoch`` and ``args`` (the run's
    settings). An unreadable file raises :class:`StructinitError`; a readable one that ``train``
    did not write, :class:`UsageError` (a foreign checkpoint has no settings to rebuild its model
    from)."""
    ck = _read_torch(path, map_location)
    if not (isinstance(ck, dict) and isinstance(ck.get("args"), dict) and isinstance(ck.get("state_dict"), dict)
            and "epoch" in ck):
        raise UsageError(f"{path} is not a checkpoint written by structinit train (checkpoint.pt or best.pt, "
                         "which hold the run's settings)")
    return ck


def _unreadable(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line (torch's own messages run to a
    page and suggest ``weights_only=False``, which would run whatever the file holds)."""
    from structinit.init.checkpoints import is_cut_short

    msg = str(exc)
    if is_cut_short(exc):
        return "not a torch checkpoint, or truncated"
    if "Weights only load failed" in msg:
        return "it needs code beyond tensors and plain containers to unpickle; nothing of it was run"
    lines = msg.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
