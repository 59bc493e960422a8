"""Real inputs for the impulse data fit of a checkpoint (``structinit apply --data SOURCE``), as the
model the checkpoint describes sees them (:func:`fit_inputs_for`).

``SOURCE`` is one of:

- a dataset structinit knows (``digits``, ``mnist1d``, and those read from ``data_dir``): for a
  ``structinit train`` checkpoint the run's own first training inputs (its subset and validation
  hold-out applied, normalized as in training); for any other checkpoint the dataset's first
  training inputs, normalized with the dataset's mean and standard deviation;
- a folder of images (searched recursively, sorted by path): each read as RGB (or grayscale for a
  one-channel model), resized to the model's input size, scaled to [0, 1] and standardized per
  channel with the batch's own mean and standard deviation;
- a tensor file (``.pt``/``.pth``: a tensor, loaded without running code; ``.npy``; ``.safetensors``:
  its one tensor, or the one named ``inputs``) of inputs already normalized as the model will see
  them: ``[B, C, H, W]`` images, ``[B, C, L]`` or ``[B, L]`` sequences, ``[B, L]`` token ids. Its
  format is read from its content (:mod:`structinit.apply.tensor_files`), and a header that promises
  more than the file holds is refused as damaged before anything is read.

``noise`` asks for no data: the fit runs on Gaussian inputs ``N(0, 1)`` of the model's input shape,
as it does without any data (the same fit for the same seed; :mod:`structinit.fit.inputs`).

At most ``samples`` inputs are used (the first ones). Floating inputs of another precision (NumPy's
float64, float16, bfloat16) are cast to float32. Inputs of the wrong shape, type or range (images
whose standard deviation is above 20 or whose mean is beyond +-10, say 0-255 pixel values) are
refused, as are tensors that hold no batch (a 0-d or sparse tensor, strings, structured records).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from structinit.atomic import NotRegularFile, regular_file
from structinit.errors import StructinitError, UsageError, param
from structinit.fit.inputs import FitInputs
from structinit.init.finite import nonfinite_text

#: Images whose standard deviation or mean magnitude exceeds these look unnormalized.
MAX_STD, MAX_MEAN = 20.0, 10.0
#: The SOURCE that asks for no data: the fit runs on Gaussian inputs (the impulse init's
#: ``data_fit_inputs="noise"``).
NOISE = "noise"


def fit_inputs_for(source, built, samples: int, data_dir: Union[str, os.PathLike, None] = None) -> FitInputs:
    """The batch ``source`` names (see the module docstring; a tensor is taken as it is) for the model
    ``built`` (a :class:`~structinit.apply.models.CheckpointModel`), checked against
    what it takes; ``data_dir`` is where a named dataset is read from (refused for any other source)."""
    from structinit.training.datasets import DATASETS

    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise UsageError(f"{param('samples')} must be a positive integer, got {samples!r}")
    if not isinstance(source, (str, os.PathLike)):
        x = as_batch(source, "the given tensor")
        got = FitInputs(x[:samples], "data", f"a tensor of {min(int(x.shape[0]), samples)} inputs")
        _no_data_dir(data_dir, "a tensor")
    else:
        text = str(source)
        if text.strip() == "":
            raise UsageError(f"{param('data')} needs a source (a dataset, an image folder, a tensor file or noise); "
                             "it is empty")
        path = Path(text).expanduser()
        if text in DATASETS and not path.exists():
            got = _dataset_inputs(text, built, samples, data_dir)
        elif path.is_dir():
            _no_data_dir(data_dir, f"the image folder {path}")
            got = _folder_inputs(path, built, samples)
        elif os.path.lexists(path):
            try:
                regular_file(path)  # a FIFO would block the read, a device (/dev/zero) never end it
            except NotRegularFile as exc:
                raise UsageError(f"{param('data')} {path}: {exc.strerror}") from None
            _no_data_dir(data_dir, f"the tensor file {path}")
            got = _file_inputs(path, samples)
        else:
            raise UsageError(f"{param('data')} {text!r} is neither a dataset ({', '.join(DATASETS)}) nor an existing "
                             "image folder or tensor file (.pt, .npy, .safetensors)")
    check_inputs(got.x, built, where=got.source)
    if got.x.is_floating_point() and got.x.dtype != _float32():
        got.x = got.x.float()  # float64 (NumPy's default), float16, bfloat16: the model's own precision
    return got


def _float32():
    import torch

    return torch.float32


def _no_data_dir(data_dir, what: str) -> None:
    if data_dir is not None:
        raise UsageError(f"{param('data_dir')} is where a named dataset is read from; {param('data')} is {what}, so "
                         "it would do nothing")


def as_batch(x, where: str):
    """``x`` as a dense tensor batch, or a :class:`UsageError` saying why it is not one (a 0-d, sparse
    or non-numeric tensor; not a tensor at all)."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise UsageError(f"{param('data')} ({where}) holds a {type(x).__name__}, not one tensor of inputs")
    if x.layout != torch.strided:
        raise UsageError(f"{param('data')} ({where}) is a sparse tensor; give a dense one (x.to_dense())")
    if x.dim() == 0:
        raise UsageError(f"{param('data')} ({where}) is a single number (a 0-d tensor); give a batch [B, ...]")
    if x.is_complex() or x.dtype == torch.bool:
        raise UsageError(f"{param('data')} ({where}) is {str(x.dtype).replace('torch.', '')}; give float inputs "
                         "normalized as the model sees them")
    return x


def _dataset_inputs(name: str, built, samples: int, data_dir) -> FitInputs:
    import dataclasses

    from structinit.training.augment import normalize
    from structinit.training.datasets import dataset_info, load_dataset
    from structinit.training.run_models import training_images

    config = built.settings
    if config is not None:
        if config.dataset != name:
            raise UsageError(f"the checkpoint's run trained on {config.dataset}; {param('data')} {name} would feed it "
                             f"other inputs (give {config.dataset})")
        if data_dir is not None:
            config = dataclasses.replace(config, data_dir=str(data_dir))
        x = training_images(config, samples)
        return FitInputs(x, "data", f"{name}: the run's first {int(x.shape[0])} training inputs")
    if built.inputs.ids:
        raise UsageError(f"the checkpoint's model takes token ids; {param('data')} {name} holds "
                         f"{dataset_info(name).kind}s (give a tensor file of token ids)")
    data = load_dataset(name, data_dir)
    info = data.info
    if not info.in_memory:
        raise UsageError(f"{param('data')} {name} streams from disk; give a folder of images or a tensor file")
    x = data.train.images[:samples]
    x = x if info.is_sequence else normalize(x, info.mean, info.std)
    return FitInputs(x, "data", f"{name}: the first {int(x.shape[0])} training inputs, normalized with its mean and "
                     "std")


def _folder_inputs(folder: Path, built, samples: int) -> FitInputs:
    import numpy as np
    import torch

    from structinit.training.datasets import IMAGE_EXTENSIONS

    if not built.inputs.images:
        raise UsageError(f"{param('data')} {folder} is a folder of images, but the checkpoint's model takes "
                         f"{built.inputs.kind}s")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)[:samples]
    if not files:
        raise UsageError(f"{param('data')} {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    from PIL import Image, UnidentifiedImageError

    chans, h, w = built.inputs.shape
    out = []
    for f in files:
        try:
            with Image.open(f) as src:
                # Pillow makes its constants in a loop its stubs do not see (Image.Resampling: Pillow >= 9.1)
                im = src.convert("L" if chans == 1 else "RGB").resize((w, h), Image.BILINEAR)  # type: ignore[attr-defined]
                arr = np.asarray(im, dtype=np.float32) / 255.0
        except (OSError, UnidentifiedImageError) as exc:
            raise UsageError(f"{param('data')}: {f} is not a readable image ({exc})") from None
        out.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
    x = torch.from_numpy(np.stack(out))
    if x.shape[1] != chans:
        raise UsageError(f"{param('data')}: the images have {x.shape[1]} channels; the model takes {chans}")
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True).clamp(min=1e-6)
    return FitInputs((x - mean) / std, "data", f"{folder}: {len(files)} images, resized to {h}x{w} and "
                     "standardized with their own mean and std")


def _file_inputs(path: Path, samples: int) -> FitInputs:
    from structinit.apply.tensor_files import read_npy, read_safetensors_inputs, tensor_file_format

    if path.suffix.lower() not in (".npy", ".safetensors", ".pt", ".pth"):
        raise UsageError(f"{param('data')} {path}: a tensor file ends in .pt, .pth, .npy or .safetensors")
    try:
        kind = tensor_file_format(path)  # the content says which, not the name
        if kind is None:
            raise UsageError(f"{param('data')} {path} is not a tensor file: its first bytes are those of no .npy, "
                             "safetensors or torch.save file")
        if kind == "npy":
            x = read_npy(path)
        elif kind == "safetensors":
            x = read_safetensors_inputs(path)
        else:
            from structinit.init.checkpoints import read_object

            x, _, _ = read_object(path)
    except UsageError:
        raise
    except StructinitError as exc:
        raise UsageError(f"{param('data')}: {exc.render()}") from None
    except (ValueError, OSError, RuntimeError) as exc:
        raise UsageError(f"{param('data')} {path} is not a readable tensor file "
                         f"({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})") \
            from None
    x = as_batch(x, str(path))
    return FitInputs(x[:samples], "data", f"{path}: the first {min(int(x.shape[0]), samples)} inputs")


def check_inputs(x, built, where: str = "the inputs") -> None:
    """Refuse inputs ``built``'s model cannot take as normalized inputs (see the module docstring)."""

    if x.dim() < 2 or int(x.shape[0]) < 1:
        raise UsageError(f"{param('data')} ({where}) must be a non-empty batch [B, ...], got shape {list(x.shape)}")
    if built.inputs.ids:
        if x.is_floating_point() or x.dim() != 2:
            raise UsageError(f"{param('data')} ({where}): the model takes token ids, int64 [B, L]; got "
                             f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}")
        vocab = _vocab(built.model)
        if int(x.min()) < 0 or (vocab is not None and int(x.max()) >= vocab):
            raise UsageError(f"{param('data')} ({where}): token ids must lie in 0..{vocab - 1 if vocab else '?'}, "
                             f"got {int(x.min())}..{int(x.max())}")
        return
    if not x.is_floating_point():
        raise UsageError(f"{param('data')} ({where}) is {str(x.dtype).replace('torch.', '')}; give float inputs "
                         "normalized as the model sees them (not raw pixel values)")
    want = tuple(built.inputs.shape)
    got = built.inputs.batch_shape(x)
    if got != want:
        raise UsageError(f"{param('data')} ({where}) has inputs of shape {list(got)}; the model takes {list(want)}")
    bad = nonfinite_text(x)
    if bad:
        raise UsageError(f"{param('data')} ({where}) holds {bad} of its {x.numel():,} values; give finite inputs")
    mean, std = float(x.float().mean()), float(x.float().std()) if x.numel() > 1 else 0.0
    if std > MAX_STD or abs(mean) > MAX_MEAN:
        raise UsageError(f"{param('data')} ({where}) does not look normalized (mean {mean:.3g}, std {std:.3g}); give "
                         "inputs as the model sees them in training, e.g. (pixels / 255 - mean) / std")


def _vocab(model) -> Optional[int]:
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None


__all__ = ["fit_inputs_for", "check_inputs", "as_batch", "NOISE"]
