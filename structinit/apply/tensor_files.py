"""One tensor of inputs from a file (``structinit apply --data FILE``): a NumPy ``.npy``, a
safetensors file or a ``torch.save`` file, told by the file's first bytes, not its name (a torch
file named ``x.safetensors`` is read as the torch file it is).

Nothing is read on a header's word: a ``.npy`` or safetensors header that promises more bytes than
the file holds (a damaged or truncated file, or one whose header claims an absurd shape) is refused
as damaged, checked against the file's size before any tensor is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Dict, Optional

from structinit.errors import UsageError, param

#: The first bytes of a NumPy ``.npy`` file.
NPY_MAGIC = b"\x93NUMPY"
#: Bytes per value of each safetensors dtype.
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                        "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: The largest safetensors header read (safetensors' own limit).
SAFETENSORS_HEADER_LIMIT = 100_000_000


def tensor_file_format(path: Path) -> Optional[str]:
    """``npy``, ``safetensors`` or ``torch`` from the first bytes of ``path``; ``None``: none of them."""
    from structinit.init.checkpoints import sniff_format

    with open(path, "rb") as fh:
        head = fh.read(len(NPY_MAGIC))
    if head == NPY_MAGIC:
        return "npy"
    return sniff_format(path)


def _damaged(path: Path, why: str) -> UsageError:
    return UsageError(f"{param('data')} {path} is damaged: {why}")


def read_npy(path: Path):
    """The array of the ``.npy`` file ``path`` as a tensor, its header checked against the file's size
    first (no pickled objects)."""
    import numpy as np
    import torch

    size = path.stat().st_size
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in readers:
                raise ValueError(f"format version {version[0]}.{version[1]}, which NumPy 1.x files do not use")
            shape, _, dtype = readers[version](fh)
        except Exception as exc:  # noqa: BLE001 - NumPy's header parser raises ValueError, SyntaxError, TokenError...
            text = str(exc).strip().splitlines()
            raise _damaged(path, f"its header cannot be read ({text[0][:160] if text else type(exc).__name__})") \
                from None
        start = fh.tell()
    if dtype.hasobject or dtype.kind not in "fiub":  # strings, structured records, dates: no numeric inputs
        raise UsageError(f"{param('data')} {path} holds {dtype} values, not numbers; give float inputs "
                         "normalized as the model sees them")
    need = math.prod(shape) * dtype.itemsize
    if need > size - start:
        raise _damaged(path, f"its header promises {list(shape)} {dtype} values ({need:,} bytes), but the file "
                             f"holds {size - start:,} after it")
    arr = np.load(path, allow_pickle=False)
    return torch.from_numpy(np.array(arr, order="C"))  # not ascontiguousarray, which makes a 0-d array 1-d


def _safetensors_header(path: Path) -> Dict[str, Any]:
    """The tensors a safetensors file's header lists, each checked to lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise _damaged(path, "it ends inside the header's length")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, SAFETENSORS_HEADER_LIMIT):
            raise _damaged(path, f"its header claims {length:,} bytes; the file holds {size - 8:,} after the length")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise _damaged(path, f"its header is not JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    body = size - 8 - length
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in entries.items():
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
            shape = [int(s) for s in entry["shape"]]
            itemsize = SAFETENSORS_ITEMSIZE[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise _damaged(path, f"its header's entry for {name!r} is not a tensor's") from None
        need = math.prod(shape) * itemsize
        if not 0 <= begin <= end <= body or end - begin != need:
            raise _damaged(path, f"tensor {name!r} claims shape {shape} ({need:,} bytes at {begin:,}..{end:,}); the "
                                 f"file holds {body:,} bytes of tensors")
    return entries


def read_safetensors_inputs(path: Path):
    """The one tensor of the safetensors file ``path``, or the one named ``inputs``; its header
    checked against the file's size before it is read."""
    from safetensors import SafetensorError, safe_open

    entries = _safetensors_header(path)
    if "inputs" in entries:
        name = "inputs"
    elif len(entries) == 1:
        name = next(iter(entries))
    else:
        raise UsageError(f"{param('data')} {path} holds {len(entries)} tensors; name the inputs 'inputs'")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _damaged(path, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__) \
            from None


__all__ = ["tensor_file_format", "read_npy", "read_safetensors_inputs", "NPY_MAGIC"]
