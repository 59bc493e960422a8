"""Checkpoint files: safe loading, finding the state dicts inside, atomic saving, and a report of
the attention structure a checkpoint's weights have.

Files: ``.safetensors`` (read with safetensors, metadata kept) and anything else as a torch pickle
(``.pt``, ``.pth``, ``.bin``...), read with ``torch.load(weights_only=True)``: only tensors and
plain containers unpickle (plus ``argparse.Namespace``, which timm's train script stores under
``args``); a pickle that needs any other code is refused and nothing of it runs.

State dicts are found in the loaded object by :data:`CONTAINER_KEYS`: the object itself when it
holds the attention tensors (a bare state dict), and every entry named there that does
(``state_dict`` and ``state_dict_ema`` of timm's training checkpoints, ``{'model': ...}``...).
Their layout comes from the table in :mod:`structinit.init.layouts`. Everything else in the file is
kept as loaded and written back unchanged.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import pickle
import re
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from structinit.atomic import NotRegularFile, read_regular, regular_file
from structinit.errors import StructinitError, UsageError
from structinit.geometry.grid import GridLike
from structinit.init.layouts import Detected, detect_layout, resolve_shape

#: Entries of a checkpoint dict that may hold a state dict, in order of preference.
CONTAINER_KEYS = ("state_dict", "state_dict_ema", "model", "model_ema", "module")

#: The largest Hugging Face ``config.json`` read (a real one is a few kB).
CONFIG_LIMIT = 16 * 2 ** 20
#: The settings file of a Hugging Face model folder, beside its weights (``save_pretrained``'s).
HF_CONFIG = "config.json"

#: Non-tensor classes the safe unpickler may build: data only, no code.
SAFE_GLOBALS = (argparse.Namespace,)


class CheckpointError(StructinitError):
    """A checkpoint that is missing, unreadable, unsafe or of an unknown layout."""

    exit_code = 1


class CheckpointNotFound(CheckpointError):
    """A checkpoint path that names no regular file (a folder, nothing, a dangling link or a loop, a
    FIFO or a device): the caller's mistake, so the CLI exits 2 as for other usage errors
    (``inspect`` does the same for a path it cannot find)."""

    exit_code = 2


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``state_dicts`` are ``(where, state_dict)`` with ``where`` the
    container path (``()`` for a bare state dict, ``('state_dict',)`` ...); ``detected`` is the
    layout of the first."""

    path: Path
    format: str  # "torch" or "safetensors"
    obj: Any  # what the file holds: a mapping (one with no state dict in it is refused when loading)
    state_dicts: List[Tuple[Tuple[str, ...], Any]]
    detected: Detected
    metadata: Optional[Dict[str, str]] = None  # a safetensors file's header metadata (None for torch files)
    extra: Dict[str, Any] = field(default_factory=dict)  # hints: arch, HF config

    @property
    def where(self) -> List[str]:
        return [".".join(w) or "(top level)" for w, _ in self.state_dicts]


def output_format(path: Union[str, os.PathLike]) -> str:
    """The format a checkpoint is written in: ``safetensors`` for a ``.safetensors`` name, else
    ``torch`` (a ``torch.save`` zip)."""
    return "safetensors" if Path(path).suffix.lower() == ".safetensors" else "torch"


def sniff_format(path: Union[str, os.PathLike]) -> Optional[str]:
    """What a file holds, from its first bytes: ``torch`` (a ``torch.save`` zip, or a legacy
    pickle), ``safetensors`` (a length-prefixed JSON header), or ``None`` (neither)."""
    with open(path, "rb") as fh:
        head = fh.read(9)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= 100_000_000:
        # A header of "{}" up to safetensors' own limit of 100 MB (the reader tells a truncated one).
        return "safetensors"
    return None


def is_cut_short(exc: BaseException) -> bool:
    """Whether ``exc``, raised by ``torch.load``, means the file is no whole torch checkpoint: a zip
    or pickle stream cut short (it runs out of input or of stack) or garbage past its first bytes,
    as opposed to a whole file that asks for something refused."""
    msg = str(exc)
    return isinstance(exc, (EOFError, IndexError)) or any(s in msg for s in ("Unsupported operand",
                                                                              "failed reading zip archive"))


# --------------------------------------------------------------------------- reading without torch

class _Stub:
    """What a torch class or function in a pickle stands for when it is read without torch:
    nothing of it is called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _stub(*args: Any, **kwargs: Any) -> _Stub:
    return _Stub()


#: Plain globals a checkpoint's pickle may name besides torch's own; any other would run code.
_PLAIN_GLOBALS = {("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): set,
                  ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
                  ("builtins", "slice"): slice, ("builtins", "bytearray"): bytearray,
                  ("argparse", "Namespace"): argparse.Namespace,
                  ("_codecs", "encode"): lambda text, encoding="latin1": str(text).encode(encoding)}


class CodeRefused(pickle.UnpicklingError):
    """A pickle names a global that is neither torch's nor a plain container: loading it would run code."""


class _Outline(pickle.Unpickler):
    """Reads a pickle's plain structure: torch's classes and functions become :class:`_Stub`,
    tensors' storages ``None``, and any other global is refused before anything of it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return _stub
        if (module, name) in _PLAIN_GLOBALS:
            return _PLAIN_GLOBALS[(module, name)]
        raise CodeRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> None:
        return None


def _pickle_bytes(path: Path) -> bytes:
    """The pickle stream of a ``torch.save`` zip (its ``data.pkl``) or of a plain pickle file."""
    try:
        size = regular_file(path).st_size
    except NotRegularFile as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from None
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes)")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head[:1] == b"\x80":
        return read_regular(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                raise CheckpointError(f"{path} is not a torch.save file (it holds no data.pkl)")
            return zf.read(names[0])
    except zipfile.BadZipFile:
        raise CheckpointError(f"{path} is not a whole torch.save file (truncated or corrupt)") from None
    except (RuntimeError, ValueError, EOFError, zlib.error) as exc:  # a member cut short or corrupt
        raise CheckpointError(f"{path} is not a whole torch.save file ({exc})") from None


def pickle_outline(path: Union[str, os.PathLike]) -> Any:
    """What a ``torch.save`` file (or a plain pickle) holds, its tensors as stand-ins, read without
    torch and without running anything in it (cheap: no tensor data is read). Raises
    :class:`CheckpointError` saying why it cannot be read: empty, not a whole ``torch.save`` file,
    or a pickle that names code (which is refused, not run)."""
    path = Path(path)
    try:
        data = _pickle_bytes(path)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        return _Outline(io.BytesIO(data)).load()
    except CodeRefused as exc:
        raise CheckpointError(f"{path} was refused: unpickling it would run code ({exc}); nothing of it was "
                              "run") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises is one line
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from None


def code_named(path: Union[str, os.PathLike]) -> Optional[str]:
    """The first global a pickle file (or ``torch.save`` zip) names that would run code, found
    without running anything; ``None`` when it names none or cannot be read that far."""
    try:
        _Outline(io.BytesIO(_pickle_bytes(Path(path)))).load()
    except CodeRefused as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - unreadable: no code found
        return None
    return None


def refused_for_code(path: Union[str, os.PathLike], name: Optional[str]) -> str:
    """The one line that says a pickle was refused because loading it would run code (``name``,
    when known)."""
    return (f"{path}: refusing to load a pickle that asks to run code{f': it asks for {name}' if name else ''} "
            "(only tensors and plain containers are loaded; nothing of it was run). Re-save it as a plain state "
            "dict (or .safetensors) from a trusted environment")


def check_checkpoint_path(path: Union[str, os.PathLike]) -> Path:
    """``path`` as a :class:`~pathlib.Path`; raises :class:`CheckpointNotFound` when it names no file
    (nothing there, a link to nothing, or a folder) and :class:`CheckpointError` when it names no
    regular file (a FIFO, whose read would wait for a writer, or a device such as ``/dev/zero``,
    whose read never ends): nothing is read from either."""
    path = Path(path)
    if not os.path.lexists(path):
        raise CheckpointNotFound(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointNotFound(f"{path}: is a folder; give the checkpoint file inside it")
    try:
        regular_file(path)
    except NotRegularFile as exc:
        cls = CheckpointError if exc.errno == errno.EFBIG else CheckpointNotFound
        raise cls(f"{path}: {exc.strerror}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return path


def read_object(path: Union[str, os.PathLike]) -> Tuple[Any, str, Optional[Dict[str, str]]]:
    """``(object, format, safetensors metadata)`` from a file, safely; raises :class:`CheckpointError`.
    The format is told by the file's content, not its name. Tensors are read onto the CPU, so a
    checkpoint saved from a GPU opens on a machine without one (and is written back from the CPU)."""
    path = check_checkpoint_path(path)
    try:
        kind = sniff_format(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if kind is None:
        raise CheckpointError(f"{path}: not a checkpoint (neither a torch.save file nor safetensors"
                              f"{'; the file is empty' if path.stat().st_size == 0 else ''})")
    if kind == "safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            out = {}
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata()
                for key in fh.keys():
                    out[key] = fh.get_tensor(key)
            return out, "safetensors", meta
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt: "
                                  f"{_first_line(exc)})") from None
    import warnings

    import torch

    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            warnings.simplefilter("ignore")  # torch's advice about weights_only; the error below says it all
            with open(path, "rb") as fh:  # a file, not its name: torch reads a name ending .safetensors as one
                obj = torch.load(fh, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
        msg = str(exc)
        if is_cut_short(exc):  # torch's own reader gave up early: refuse code it did not reach, else unreadable
            code = code_named(path)
            if code is not None:
                raise CheckpointError(refused_for_code(path, code)) from None
            raise CheckpointError(f"{path}: not a readable checkpoint (not a torch or safetensors file, or "
                                  "truncated)") from None
        if "Weights only load failed" in msg:
            # torch names it "GLOBAL module.name" (after "Unsupported global:", in torch 2.4 on).
            m = re.search(r"GLOBAL\s+([\w.]+)", msg)
            raise CheckpointError(refused_for_code(path, m.group(1) if m else code_named(path))) from None
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {_first_line(exc)})") from None
    return obj, "torch", None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _keys_seen(obj: Any, limit: int = 12) -> str:
    if not isinstance(obj, Mapping):
        return f"a {type(obj).__name__}, not a dict"
    parts = []
    for k, v in obj.items():
        if isinstance(v, Mapping) and k in CONTAINER_KEYS:
            inner = list(v)[:limit]
            parts.append(f"{k}: {{{', '.join(map(str, inner))}{', ...' if len(v) > limit else ''}}}")
        else:
            parts.append(str(k))
        if len(parts) >= limit:
            parts.append("...")
            break
    return ", ".join(parts) if parts else "(empty)"


def find_state_dicts(obj: Any) -> List[Tuple[Tuple[str, ...], Any, Detected]]:
    """Every state dict in ``obj`` (see :data:`CONTAINER_KEYS`) with its detected layout."""
    from structinit.init.family import load_families

    load_families()  # the layout rows families add are tried first
    found: List[Tuple[Tuple[str, ...], Any, Detected]] = []
    if isinstance(obj, Mapping):
        det = detect_layout(obj)
        if det is not None:
            found.append(((), obj, det))
        for key in CONTAINER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                det = detect_layout(inner)
                if det is not None:
                    found.append(((key,), inner, det))
    return found


def load_checkpoint(path: Union[str, os.PathLike]) -> Checkpoint:
    """Load ``path`` safely and detect its layout; raises :class:`CheckpointError` (unknown layouts
    list the keys seen)."""
    path = Path(path)
    obj, fmt, meta = read_object(path)
    found = find_state_dicts(obj)
    if not found:
        raise CheckpointError(f"{path}: unknown checkpoint layout (no timm, Hugging Face ViT/BERT/GPT-2 or "
                              f"nn.MultiheadAttention attention weights); keys seen: {_keys_seen(obj)}")
    first = found[0][2]
    for where, _, det in found[1:]:
        if (det.layout.name, det.dim, det.depth) != (first.layout.name, first.dim, first.depth):
            raise CheckpointError(f"{path}: the state dicts in the file disagree ({'.'.join(where)} is a "
                                  f"{det.layout.name} of dim {det.dim}, depth {det.depth})")
    ckpt = Checkpoint(path=path, format=fmt, obj=obj, state_dicts=[(w, sd) for w, sd, _ in found],
                      detected=first, metadata=meta)
    _shape_hints(ckpt)
    return ckpt


#: Entry of a checkpoint written by ``structinit train``: ``{"grid": [...], "heads": H}``, the token grid
#: (one side for a sequence) and heads the weights alone do not tell.
SHAPE_KEY = "shape"


def _shape_hints(ckpt: Checkpoint) -> None:
    """Heads (and a sequence's grid) from what the file or its folder tells: the ``shape`` entry of
    a ``structinit train`` checkpoint, else what the family of its layout reads
    (:meth:`~structinit.init.family.ModelFamily.checkpoint_hints`: a Hugging Face ``config.json``
    beside it, the ``arch`` of a timm training checkpoint)."""
    from structinit.init.family import family_of_layout

    if _structinit_shape(ckpt):
        return
    family_of_layout(ckpt.detected.layout).checkpoint_hints(ckpt)


def _structinit_shape(ckpt: Checkpoint) -> bool:
    """Apply the ``shape`` entry of a ``structinit train`` checkpoint when it fits the weights."""
    from structinit.errors import UsageError
    from structinit.geometry.grid import Grid

    shape = ckpt.obj.get(SHAPE_KEY)
    det = ckpt.detected
    if not isinstance(shape, Mapping):
        return False
    try:
        grid = Grid(shape["grid"])
    except (KeyError, UsageError):  # no grid, or not one
        return False
    heads = shape.get("heads")
    pos_rows = None
    if det.pos_key is not None:
        pos_shape = tuple(getattr(ckpt.state_dicts[0][1][det.pos_key], "shape", ()))
        pos_rows = pos_shape[-2] - det.prefix_tokens if len(pos_shape) >= 2 else None
    if pos_rows is not None and pos_rows != grid.tokens:
        return False
    if isinstance(heads, int) and heads > 0 and det.dim % heads == 0:
        det.heads = heads
    det.grid = grid
    ckpt.extra["shape"] = {"grid": list(grid), "heads": det.heads}
    return True


def safetensors_dict(ckpt: Checkpoint, path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """``ckpt.obj`` as safetensors can hold it (a flat map of names to tensors), or an error naming
    what does not fit."""
    import torch

    obj = ckpt.obj
    if not isinstance(obj, Mapping):
        raise UsageError(f"{path}: a .safetensors file holds a flat map of tensors; the checkpoint is a "
                              f"{type(obj).__name__}. Choose a .pt/.pth output name")
    other = [str(k) for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if other:
        raise UsageError(f"{path}: a .safetensors file holds a flat map of tensors, and this checkpoint also "
                              f"holds {', '.join(other[:6])}{' ...' if len(other) > 6 else ''}; choose a .pt/.pth "
                              "output name (or extract the state dict first)")
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in obj.items()}


def save_checkpoint(ckpt: Checkpoint, path: Union[str, os.PathLike], *, exclusive: bool = False,
                    file_mode: Optional[int] = None) -> Path:
    """Write ``ckpt.obj`` to ``path`` in the format its name says (:func:`output_format`),
    atomically (temp file beside it, fsync, then moved into place); on failure nothing is left
    behind. ``exclusive``: fail with :class:`CheckpointError` if ``path`` exists by then (another
    process wrote it), never replacing it. ``file_mode``: the permission bits to give it."""
    from structinit.atomic import OutputExists, atomic_write, save_torch

    path = Path(path)
    fmt = output_format(path)
    if fmt == "safetensors":
        from safetensors.torch import save

        data = save(safetensors_dict(ckpt, path), metadata=ckpt.metadata)
    try:
        if fmt == "safetensors":
            with atomic_write(path, exclusive=exclusive, file_mode=file_mode) as fh:
                fh.write(data)
        else:
            save_torch(ckpt.obj, path, exclusive=exclusive, file_mode=file_mode)
    except OutputExists:
        raise CheckpointError(f"{path} appeared while this was being written (another process?); it was not "
                              "replaced, and nothing was written") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc}); nothing was written") from None
    return path


# --------------------------------------------------------------------------- describe

def describe_state_dict(sd: Mapping, det: Detected, heads: Optional[int] = None, grid: Optional[GridLike] = None,
                        offsets: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """Attention quality of every layer of ``sd``, from its weights, against the impulse offset each
    head follows most (or ``offsets [layers, heads, 2]`` when known), on what its first layer sees
    on position alone: its own position embedding, LayerNorm'd (prefix-token rows dropped), or the
    LayerNorm'd sin-cos table when it has none; ``measured_on`` says which. JSON-able."""
    from structinit.analysis.quality import closest_offsets, measure
    from structinit.geometry.embedding import layer_norm, sincos
    from structinit.geometry.targets import causal_mask, impulse_columns
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.inject import read_qk

    grid, heads = resolve_shape(det, heads, grid)
    assert grid is not None  # resolve_shape refuses a missing grid (need_grid)
    view = AttentionTarget(sd, grid, heads)
    own = view.own_input()
    kind = view.pos_embed_kind()
    if own is not None:
        x, measured_on = own, f"{det.pos_key} ({kind}), LayerNorm'd"
    else:
        x, measured_on = layer_norm(sincos(grid, det.dim)), "the LayerNorm'd sin-cos table (no position embedding)"
    mask = causal_mask(grid, bool(det.layout.causal))  # a decoder (GPT-2) sees only the past
    layers = []
    for slot in det.slots:
        q, k = read_qk(sd, slot, heads)
        offs = offsets[slot.index] if offsets is not None else closest_offsets(x, q, k, grid, mask)
        got = measure(x, q, k, impulse_columns(grid, offs), mask)
        layers.append({"layer": slot.index, "offsets": np.asarray(offs).tolist(), **got.layer_row(),
                       "q_norm": float(got.q_norm.mean()), "k_norm": float(got.k_norm.mean())})
    out = det.summary()
    out.update(grid=list(grid), heads=heads, tokens=grid.tokens, layers=layers, pos_embed_kind=kind,
               measured_on=measured_on)
    return out


def describe_checkpoint(path: Union[str, os.PathLike], heads: Optional[int] = None,
                        grid: Optional[GridLike] = None) -> Dict[str, Any]:
    """Layout, shape (grid, dim, heads, depth) and per-layer attention quality of a checkpoint file.

    ``heads``/``grid`` are needed only where the file does not tell. Per-layer ``hit_rate``,
    ``target_mass``, ``mse`` are computed from the written weights (see :func:`describe_state_dict`).
    """
    ckpt = load_checkpoint(path)
    desc = describe_state_dict(ckpt.state_dicts[0][1], ckpt.detected, heads, grid)
    desc.update(path=str(ckpt.path), format=ckpt.format, state_dicts=ckpt.where, hints=ckpt.extra)
    return desc
