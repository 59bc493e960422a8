"""A checkpoint file read for ``apply`` and the file written (:func:`load_for_apply`,
:func:`write_output`), and the names of both.

Files: the output's format follows its name (``.safetensors``: safetensors, anything else a
``torch.save`` file) and it gets the input's permission bits. A Hugging Face folder (what
``save_pretrained`` writes: ``config.json`` and one weights file, ``model.safetensors`` or
``pytorch_model.bin``) is read as its weights file, and written as a folder of the same files
(:func:`hf_folder`): ``DIR.METHOD`` beside it by default, which ``from_pretrained`` loads.
Nothing the user has is replaced unless asked: an existing output is refused (``force`` replaces
it; an output folder replaced is kept as ``OUT.bak``), a new one is created exclusively (of two runs
writing the same name, one wins and the other is told), and ``in_place`` keeps the original as
``CKPT.bak`` (``CKPT.bak.1``, ... when that exists: a backup is never overwritten) and then
replaces the input atomically (of a folder, its weights file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from structinit.apply.options import DEFAULT_PE_SCALE, ApplyOptions
from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid
from structinit.init.attention_target import AttentionTarget
from structinit.init.base import InitSpec
from structinit.init.checkpoints import (
    HF_CONFIG,
    Checkpoint,
    CheckpointError,
    check_checkpoint_path,
    load_checkpoint,
    output_format,
    safetensors_dict,
    save_checkpoint,
)
from structinit.init.family import family_for_checkpoint
from structinit.init.finite import attention_keys, check_finite, check_float_weights, model_tensors
from structinit.init.layouts import heads_unknown

#: File-name endings of checkpoints, kept after the method's name in a default output name.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".tar", ".ckpt", ".safetensors", ".gz")


def default_output(path: Path, method: str) -> Path:
    """``NAME.METHOD.EXT`` beside the input, ``EXT`` being its checkpoint endings (``vit.pth`` ->
    ``vit.impulse.pth``, ``run.pth.tar`` -> ``run.impulse.pth.tar``)."""
    name, ends = path.name, ""
    while Path(name).suffix.lower() in CHECKPOINT_SUFFIXES and Path(name).stem:
        ends = Path(name).suffix + ends
        name = Path(name).stem
    return path.with_name(f"{name}.{method}{ends}")


#: The weights file of a Hugging Face folder, in the order ``from_pretrained`` prefers them.
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def hf_folder(folder: Path) -> Path:
    """The weights file of the Hugging Face folder ``folder`` (as ``save_pretrained`` writes it:
    ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``). Raises
    :class:`~structinit.init.checkpoints.CheckpointNotFound` for a folder that is not one (no
    config.json, no weights file) and :class:`UsageError` for weights split into shards, or held
    twice (``model.safetensors`` and ``pytorch_model.bin``: one would be written, the other left stale)."""
    from structinit.init.checkpoints import CheckpointNotFound

    sharded = [f"{name}.index.json" for name in HF_WEIGHTS if (folder / f"{name}.index.json").exists()]
    if sharded:
        raise UsageError(f"{folder}: its weights are split into shards ({sharded[0]}); structinit reads one weights "
                         "file: save the model with save_pretrained(..., max_shard_size=\"100GB\") first")
    present = [folder / name for name in HF_WEIGHTS if (folder / name).exists()]
    if len(present) > 1 and (folder / HF_CONFIG).exists():  # one would be initialized, the other copied stale
        raise UsageError(f"{folder} holds both {' and '.join(HF_WEIGHTS)}; structinit initializes one weights "
                         f"file, and the other would be copied beside it unchanged (from_pretrained reads "
                         f"{HF_WEIGHTS[0]} first): remove the one the model does not use, or give its file")
    found = present[0] if present else None
    if found is None or not (folder / HF_CONFIG).exists():
        raise CheckpointNotFound(f"{folder}: is a folder; give the checkpoint file inside it (a Hugging Face folder "
                                 f"holds config.json and {' or '.join(HF_WEIGHTS)})")
    return found


def _folder_output(folder: Path, method: str, out: Union[str, os.PathLike, None], in_place: bool, force: bool) -> Path:
    """Where a Hugging Face folder's output goes: a new folder (``DIR.METHOD`` beside it by default);
    an existing one only with ``force`` (it is then kept as ``OUT.bak``, see :func:`_write_folder`)."""
    if in_place:
        return folder.resolve()
    if out is not None and str(out).strip() == "":
        raise UsageError(f"{param('out')} needs a folder name (the input is a Hugging Face folder)")
    target = Path(out).expanduser() if out is not None else folder.with_name(f"{folder.name}.{method}")
    if target.resolve() == folder.resolve():
        raise UsageError(f"{param('out')} {target} is the input folder; use {param('in_place')} to replace its "
                         "weights (a backup is kept)")
    if not target.parent.is_dir():
        raise UsageError(f"{param('out')} {target}: folder {target.parent} does not exist")
    if os.path.lexists(target) and (target.is_symlink() or not target.is_dir()):
        raise UsageError(f"{param('out')} {target} exists and is not a folder; the output of a Hugging Face folder "
                         "is a folder")
    if target.exists() and not force:
        how = "" if out is not None else f" (the default output name; choose another with {param('out')})"
        raise UsageError(f"{target} already exists{how}; pass {param('force')} to replace it (it is kept as "
                         f"{target.name}.bak)")
    return target


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _output_path(path: Path, method: str, out: Union[str, os.PathLike, None], in_place: bool, force: bool) -> Path:
    if in_place and out is not None:
        raise UsageError(f"give either {param('out')} or {param('in_place')}, not both")
    if in_place:
        return path.resolve()  # a symlink's file is replaced, not the link
    if out is not None and str(out).strip() == "":
        raise UsageError(f"{param('out')} needs a file name")
    target = Path(out).expanduser() if out is not None else default_output(path, method)
    if target.is_dir():
        raise UsageError(f"{param('out')} {target} is a folder; give a file name")
    if _same_file(path, target):
        raise UsageError(f"{param('out')} {target} is the input file; use {param('in_place')} to replace it "
                         "(a backup is kept)")
    if not target.parent.is_dir():
        raise UsageError(f"{param('out')} {target}: folder {target.parent} does not exist")
    if target.exists() and not force:
        how = "" if out is not None else f" (the default output name; choose another with {param('out')})"
        raise UsageError(f"{target} already exists{how}; pass {param('force')} to replace it")
    if target.exists() and not target.is_file():
        raise UsageError(f"{param('out')} {target} exists and is not a regular file")
    return target


@dataclass
class LoadedCheckpoint:
    """A checkpoint read for :func:`write_checkpoint`: the file, its state-dict ``views``
    (:class:`~structinit.init.attention_target.AttentionTarget` each), where the output goes, the input's
    ``stat`` (an in-place replace checks the file did not change) and the ``plan`` (the report so far)."""

    path: Path
    ckpt: Checkpoint
    views: List[AttentionTarget]
    target: Path
    stat: Optional[os.stat_result]
    plan: Dict[str, Any]
    folder: Optional[Path] = None  # a Hugging Face folder given (path is its weights file; target a folder)

    @property
    def first(self) -> AttentionTarget:
        return self.views[0]


def load_for_apply(path: Union[str, os.PathLike], spec: InitSpec, options: ApplyOptions) -> LoadedCheckpoint:
    """Read checkpoint ``path`` and plan what ``spec`` with ``options`` writes, refusing what cannot be
    done before any work (the output name, the shape, the position embedding, a safetensors output
    that cannot hold the file's entries)."""
    folder = Path(path) if Path(path).is_dir() and not options.in_place else None
    if Path(path).is_dir():
        path = hf_folder(Path(path))  # a save_pretrained folder: its weights file (in place: replaced in it)
    path = check_checkpoint_path(path)  # before the output's name, which is made from it
    options.check(spec)
    if folder is not None:
        target = _folder_output(folder, spec.method, options.out, options.in_place, options.force or options.dry_run)
    else:
        target = _output_path(path, spec.method, options.out, options.in_place, options.force or options.dry_run)
    try:
        stat = path.stat()  # before reading: an in-place replace checks that the file is still this one
    except OSError:
        stat = None
    ckpt = load_checkpoint(path)
    det = ckpt.detected
    for where, (_, sd) in zip(ckpt.where, ckpt.state_dicts):  # before any work: weights an init cannot take
        label = f"the checkpoint {path}" + ("" if where.startswith("(") else f", {where}")  # "(top level)": no name
        check_float_weights(((k, sd.get(k)) for k in attention_keys(det)), label)
        check_finite(model_tensors(sd), label)
    heads = options.heads if options.heads is not None else _named_model_heads(options.model_name, det.dim)
    heads = heads if heads is not None else det.heads  # the file's hints (HF config.json, timm arch)
    if heads is None and det.heads_note is not None:  # a config.json that should tell them cannot be read
        raise heads_unknown(det)
    needed = family_for_checkpoint(ckpt).heads_needed(det) if heads is None and spec.uses_data else None
    if needed is not None:  # what the family says (a named timm model tells its heads)
        raise UsageError(needed)
    grid = options.grid
    if grid is None and "shape" in ckpt.extra:  # a structinit train checkpoint tells its grid (a sequence's too),
        grid = det.grid  # which the views, detected afresh from the weights alone, would not know
    views = [AttentionTarget(sd, Grid(grid) if grid is not None else None, heads, options.layers,
                             need_grid=spec.needs_grid or options.set_pe is not None) for _, sd in ckpt.state_dicts]
    first = views[0]
    if not spec.needs_model:  # a method that needs the model is checked on the model apply builds
        spec.check_target(first)
    if options.set_pe is not None and det.pos_key is None:
        raise UsageError(f"{param('set_pe')}: the {det.layout.name} checkpoint has no position embedding")
    weights_out = target / path.name if folder is not None else target
    if output_format(weights_out) == "safetensors":
        safetensors_dict(ckpt, weights_out)  # refuse now what cannot be written as safetensors
    pe_scale = (DEFAULT_PE_SCALE if options.pe_scale is None else options.pe_scale) if options.set_pe else None
    plan = {
        "input": str(folder if folder is not None else path), "output": str(target), "in_place": options.in_place,
        "backup": None, "format": ckpt.format, "output_format": output_format(weights_out),
        "state_dicts": ckpt.where, **det.summary(), "heads": first.heads,
        "grid": list(first.grid) if first.grid else None, "method": spec.method, "params": spec.params(),
        "seed": options.seed, "set_pe": options.set_pe, "pe_scale": pe_scale,
        "pos_embed_kind": first.pos_embed_kind(), "pos_embed_written": None, "hints": ckpt.extra,
        "layers": [{"layer": slot.index, "replaced": spec.planned(slot)} for slot in first.slots],
    }
    if options.set_pe:
        plan["pos_embed_replaced"] = det.pos_key
    if first.grid is not None:
        spec.check_shape(first.grid, first.dim, first.heads, first.depth, options.seed,  # refuses bad settings first
                         cache_dir=options.cache_dir)
    if folder is not None:
        plan["weights"] = str(weights_out)  # the weights file inside the output folder
    return LoadedCheckpoint(path, ckpt, views, target, stat, plan, folder)


def _named_model_heads(model_name: Optional[str], dim: int) -> Optional[int]:
    """The heads of the timm model ``model_name`` names (``None`` without one), refused when they
    cannot be the checkpoint's (they do not divide its ``dim``): the model is then not the one it holds."""
    if model_name is None:
        return None
    from structinit.apply.models import timm_heads

    heads = timm_heads(model_name)
    if dim % heads:
        raise UsageError(f"{param('model_name')} {model_name} has {heads} heads, which do not divide the "
                         f"checkpoint's dim {dim}: the checkpoint holds another model (name it, or give "
                         f"{param('heads')})")
    return heads


def write_position_table(loaded: LoadedCheckpoint, scale: float) -> None:
    """Write the sin-cos table (times ``scale``) into the position embedding of every copy of the
    model in the file."""
    from structinit.init.pos_embed import write_sincos

    key = loaded.ckpt.detected.pos_key
    assert key is not None  # load_for_apply refuses set_pe without one, and a table replaces one
    for view in loaded.views:
        assert view.grid is not None  # the views of a table's checkpoint have their grid (need_grid)
        write_sincos(view.sd[key], view.grid, scale, name=key)


def write_output(loaded: LoadedCheckpoint, options: ApplyOptions, plan: Dict[str, Any]) -> None:
    """Write the checkpoint ``loaded`` holds (its copies initialized) where :func:`load_for_apply`
    planned: a new file, the input replaced (``in_place``), or a Hugging Face folder."""
    if loaded.folder is not None:
        _write_folder(loaded, options.force, plan)
    else:
        _write(loaded.ckpt, loaded.path, loaded.target, loaded.stat, options.in_place, options.force, plan)


def _write_folder(loaded: LoadedCheckpoint, force: bool, plan: Dict[str, Any]) -> None:
    """Write a Hugging Face folder's output: a new folder holding the written weights under the input's
    weights name and a copy of every other file of the input folder (``config.json`` first), made as
    a hidden temp folder beside it and renamed into place, so that it is whole or absent. An existing
    output (``force``) is kept as ``OUT.bak`` (``OUT.bak.1``, ...), never deleted."""
    import shutil
    import tempfile

    from structinit.atomic import copy_file, regular_file, set_aside

    assert loaded.folder is not None
    target = loaded.target
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        raise CheckpointError(f"cannot write into {target.parent}: {exc.strerror or exc}; nothing was written") \
            from None
    try:
        for item in sorted(loaded.folder.iterdir()):
            if item.name == loaded.path.name or item.name.startswith("."):
                continue
            try:
                regular_file(item)
            except OSError:  # a sub-folder, a FIFO, a link to nothing: not part of what from_pretrained reads
                continue
            try:
                copy_file(item, tmp / item.name)
            except OSError as exc:
                raise CheckpointError(f"cannot copy {item} into {target}: {exc.strerror or exc}; nothing was "
                                      "written") from None
        file_mode = loaded.stat.st_mode if loaded.stat is not None else None
        save_checkpoint(loaded.ckpt, tmp / loaded.path.name, exclusive=True, file_mode=file_mode)
        os.chmod(tmp, loaded.folder.stat().st_mode & 0o7777)  # the input folder's permission bits, not mkdtemp's
        if os.path.lexists(target):
            if not force:
                raise CheckpointError(f"{target} appeared while this was being written (another process?); it was not "
                                      "replaced, and nothing was written")
            plan["backup"] = str(set_aside(target, ".bak"))
        try:
            os.rename(tmp, target)
        except OSError as exc:
            raise CheckpointError(f"cannot put {target} in place ({exc.strerror or exc}); nothing was written") \
                from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write(ckpt: Checkpoint, path: Path, target: Path, stat: Optional[os.stat_result], in_place: bool, force: bool,
           plan: Dict[str, Any]) -> None:
    """Write the checkpoint: a new file created exclusively (or replacing one with ``force``), or,
    in place, a numbered backup of the input first and then the input replaced atomically.
    ``stat``: the input's, read before it was loaded (``None`` where it could not be: the output then
    gets the umask's permission bits, and the input is not replaced, as it cannot be told unchanged)."""
    from structinit.atomic import claim_backup

    file_mode = stat.st_mode if stat is not None else None
    if not in_place:
        save_checkpoint(ckpt, target, exclusive=not force, file_mode=file_mode)
        return
    now = target.stat()
    if stat is None or (now.st_ino, now.st_mtime_ns, now.st_size) != (stat.st_ino, stat.st_mtime_ns, stat.st_size):
        raise StructinitError(f"{path} changed while it was being initialized (another process?); it was not "
                              "replaced")
    try:
        backup = claim_backup(target)
    except OSError as exc:
        raise CheckpointError(f"cannot keep a backup of {path}: {exc.strerror or exc}; the input was not "
                              "replaced") from None
    plan["backup"] = str(backup)
    try:
        save_checkpoint(ckpt, target, file_mode=file_mode)
    except CheckpointError:
        backup.unlink(missing_ok=True)  # the input is unchanged; the backup would only be a duplicate
        raise


__all__ = ["LoadedCheckpoint", "load_for_apply", "write_position_table", "write_output", "default_output", "hf_folder",
           "HF_WEIGHTS", "CHECKPOINT_SUFFIXES"]
