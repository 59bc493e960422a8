"""A training run's checkpoints read back: ``checkpoint.pt`` (:func:`load_train_checkpoint`), a
run's weights (:func:`load_run_weights`, ``checkpoint.pt`` or ``best.pt``), and a checkpoint's plain
fields without torch (:func:`checkpoint_info`). Every read is ``weights_only``: nothing in the file
runs, and every failure is one line saying why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Union

from structinit.atomic import regular_file
from structinit.errors import StructinitError, UsageError

CHECKPOINT_FORMAT = "structinit-train/1"


def checkpoint_info(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """A training checkpoint's plain fields (``epoch``, ``key``, ``format``, ...; tensors as
    stand-ins), read without torch and without running anything in the file. Raises
    :class:`StructinitError` saying why it cannot be read (empty, not a ``torch.save`` zip, cut
    short, or a pickle that would run code)."""
    from structinit.init.checkpoints import pickle_outline

    obj = pickle_outline(path)
    if not isinstance(obj, dict):
        raise StructinitError(f"{path} holds a {type(obj).__name__}, not a training checkpoint")
    return obj


def _read_torch(path: Union[str, os.PathLike], map_location) -> Any:
    """``torch.load(path, weights_only=True)`` of a regular file (a FIFO would block the read, a
    device never end it); every failure is one :class:`StructinitError` line."""
    import torch

    from structinit.init.checkpoints import sniff_format

    try:
        regular_file(Path(path))
    except OSError as exc:
        raise StructinitError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    try:
        if sniff_format(path) == "torch":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's advice about weights_only; the error below says it all
                return torch.load(path, map_location=map_location, weights_only=True)
        why = "not a torch checkpoint, or truncated"  # its first bytes are neither a torch.save zip nor a pickle
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
        why = _unreadable(exc, path)
    raise StructinitError(f"cannot read checkpoint {path}: {why}")


def load_train_checkpoint(path: Union[str, os.PathLike], map_location="cpu") -> Dict[str, Any]:
    """A ``checkpoint.pt`` written by :func:`structinit.train` (read with ``weights_only=True``)."""
    ck = _read_torch(path, map_location)
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise StructinitError(f"{path} is not a structinit training checkpoint")
    return ck


def load_run_weights(path: Union[str, os.PathLike], map_location="cpu") -> Dict[str, Any]:
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


def _unreadable(exc: BaseException, path: Union[str, os.PathLike, None] = None) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line (torch's own messages run to a
    page and suggest ``weights_only=False``, which would run whatever the file holds)."""
    from structinit.init.checkpoints import code_named, is_cut_short

    msg = str(exc)
    if path is not None and ("Weights only load failed" in msg or is_cut_short(exc)):
        code = code_named(path)  # torch may give up before it reaches the code a pickle names
        if code is not None:
            return f"refused: unpickling it would run code ({code}); nothing of it was run"
    if is_cut_short(exc):
        return "not a torch checkpoint, or truncated"
    if "Weights only load failed" in msg:
        return "it needs code beyond tensors and plain containers to unpickle; nothing of it was run"
    lines = msg.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
