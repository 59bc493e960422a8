"""Datasets for ``structinit train``: what they are, where they live on disk, and how to load them.

Small image datasets (``digits``, ``synthetic``, ``fashion-mnist``, ``cifar10``, ``cifar100``,
``svhn``) load whole
into memory as uint8 images ``[N, C, H, W]`` and int64 labels ``[N]``, so training can keep them on
the GPU and augment there. ``imagefolder`` (ImageNet layout) streams from disk through a
DataLoader. Sequence datasets (``mnist1d``) load as float32 sequences ``[N, C, L]``, already
standardized (:attr:`DatasetInfo.kind` is ``"sequence"``).

Example::

    from structinit.training.datasets import load_dataset
    data = load_dataset("digits")
    data.train.images.shape, data.test.images.shape  # (1437, 1, 8, 8), (360, 1, 8, 8)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from structinit.errors import StructinitError, UsageError, param


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts of a dataset: classes, image side (a sequence's length) and channels,
    normalization, the default patch size for a ViT on it, whether horizontal flips keep labels, the
    default augmentation, and ``kind``: ``image`` (uint8 ``[N, C, H, W]``) or ``sequence`` (float32
    ``[N, C, L]``, used as stored)."""

    name: str
    num_classes: int
    image_size: int
    in_chans: int
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    default_patch: int
    hflip: bool
    augment: str
    in_memory: bool = True
    kind: str = "image"

    @property
    def is_sequence(self) -> bool:
        return self.kind == "sequence"


DATASETS: Dict[str, DatasetInfo] = {
    # scikit-learn's 8x8 digits (values 0-16, stored here as round(v * 255 / 16)); fixed split.
    "digits": DatasetInfo("digits", 10, 8, 1, (0.3054,), (0.3760,), 1, False, "none"),
    # Oriented bars on noise: 4 classes, 8x8, seeded; for tests and smoke runs.
    "synthetic": DatasetInfo("synthetic", 4, 8, 1, (0.5,), (0.25,), 1, False, "none"),
    "cifar10": DatasetInfo("cifar10", 10, 32, 3, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 2, True,
                           "randaugment"),
    "cifar100": DatasetInfo("cifar100", 100, 32, 3, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 2, True,
                            "randaugment"),
    "svhn": DatasetInfo("svhn", 10, 32, 3, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970), 2, False,
                        "randaugment"),
    # ImageNet layout; classes counted from the folders at load time, images resized to --image-size.
    "imagefolder": DatasetInfo("imagefolder", 0, 224, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 16, True,
                               "randaugment", in_memory=False),
    # MNIST-1D (Greydanus): mnist1d's make_dataset() with its default arguments, 4000 train / 1000 test
    # sequences of 40 values, 10 classes; standardized by the package itself.
    "mnist1d": DatasetInfo("mnist1d", 10, 40, 1, (0.0,), (1.0,), 1, False, "none", kind="sequence"),
    # Fashion-MNIST (Xiao et al.): the original IDX files, 60,000 train / 10,000 test 28x28 grayscale
    # images of 10 clothing classes. Mean and std of the 60,000 training images (pixels / 255). Random
    # crops (4-pixel zero padding) and horizontal flips: every class keeps its label in a mirror image
    # (a shoe pointing right is still a sneaker); the test images are never augmented.
    "fashion-mnist": DatasetInfo("fashion-mnist", 10, 28, 1, (0.2860,), (0.3530,), 4, True, "crop-flip"),
}
#: Where Debian's dataset-fashion-mnist package puts the original files.
FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                 "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]
#: Datasets whose positions may be shuffled (one fixed permutation of the sequence axis).
SHUFFLABLE = ("mnist1d",)

DIGITS_TEST = 360
SYNTHETIC_SIZES = (512, 256)

_EXPECTED = {
    "cifar10": ("cifar-10-batches-py", ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                                        "data_batch_5", "test_batch", "batches.meta"),
                "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html"),
    "cifar100": ("cifar-100-python", ("train", "test", "meta"),
                 "cifar-100-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html"),
    "svhn": ("", ("train_32x32.mat", "test_32x32.mat"), "train_32x32.mat and test_32x32.mat from "
             "http://ufldl.stanford.edu/housenumbers/"),
}


@dataclass
class TensorSplit:
    """One split in memory: ``images`` uint8 ``[N, C, H, W]``, ``labels`` int64 ``[N]``."""

    images: Any
    labels: Any

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class Data:
    """A loaded dataset: ``train``/``test`` (and ``val`` when held out, see :func:`split_train`) are
    :class:`TensorSplit` (in memory) or torch ``Dataset`` objects yielding ``(float image [C, S, S]
    normalized, label)`` (``imagefolder``)."""

    info: DatasetInfo
    train: Any
    test: Any
    classes: Optional[list] = field(default=None)
    val: Any = None


def stratified_indices(labels, n: int, seed: int):
    """``n`` indices into ``labels`` (int ``[M]``), sorted, with each class in proportion (largest
    remainders get the rounding), drawn without replacement by a NumPy generator seeded ``seed``."""
    import numpy as np

    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * n / counts.sum()
    take = np.floor(quota).astype(int)
    order = np.argsort(-(quota - take), kind="stable")
    take[order[: n - int(take.sum())]] += 1
    rng = np.random.default_rng(seed)
    parts = [rng.choice(np.flatnonzero(labels == c), size=int(t), replace=False) for c, t in zip(classes, take)]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


#: Seed of the held-out validation images: the same validation set for every run seed.
VAL_SEED = 1_000_003


def split_train(data: Data, train_size: Optional[int] = None, val_size: int = 0, seed: int = 0) -> Data:
    """``data`` with ``val_size`` training images held out as ``val`` (stratified, the same for every
    ``seed``) and the training split cut to a stratified subset of ``train_size`` of the rest
    (drawn with ``seed``). In-memory datasets only; the test split is never touched."""
    import torch

    if not train_size and not val_size:
        return data
    if not data.info.in_memory:
        raise UsageError(f"{param('train_size')} and {param('val_size')} apply to in-memory datasets, "
                         f"not {data.info.name}")
    n = len(data.train)
    labels = data.train.labels.numpy()
    if val_size >= n:
        raise UsageError(f"{param('val_size')} {val_size} leaves no training images of the {n} in {data.info.name}")
    val_idx = stratified_indices(labels, val_size, VAL_SEED) if val_size else np.zeros(0, dtype=np.int64)
    rest = np.setdiff1d(np.arange(n), val_idx)
    if train_size:
        if train_size > len(rest):
            after = f" left after {param('val_size')} {val_size}" if val_size else ""
            raise UsageError(f"{param('train_size')} {train_size} is more than the {len(rest)} training images "
                             f"of {data.info.name}{after}")
        rest = rest[stratified_indices(labels[rest], train_size, seed)]

    def take(idx):
        t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        return TensorSplit(data.train.images[t], data.train.labels[t])

    return Data(data.info, take(rest), data.test, data.classes, take(val_idx) if val_size else None)


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise UsageError(f"unknown {param('dataset')} {name!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[name]


def default_data_dir() -> Path:
    """``$STRUCTINIT_DATA``, else ``./data``."""
    return Path(os.environ.get("STRUCTINIT_DATA") or "data")


def load_dataset(name: str, data_dir: Union[str, os.PathLike, None] = None, download: bool = False,
                 image_size: Optional[int] = None, shuffle_seq: bool = False) -> Data:
    """Load ``name``'s train and test splits. ``data_dir`` holds the on-disk files (torchvision's
    formats; ``imagefolder``: ``train/`` and ``val/`` with one folder per class); ``download``
    fetches them first (torchvision sets only). ``image_size`` applies to ``imagefolder``;
    ``shuffle_seq`` to ``mnist1d`` (its positions permuted, the same permutation for every sequence).

    A missing or malformed directory raises :class:`UsageError` naming what was expected where.
    """
    info = dataset_info(name)
    if shuffle_seq and name not in SHUFFLABLE:
        raise UsageError(f"{param('shuffle_seq')} applies to sequence datasets ({', '.join(SHUFFLABLE)}), "
                         f"not {name}")
    if name == "mnist1d":
        return _mnist1d(info, shuffle_seq)
    if name == "digits":
        return _digits(info)
    if name == "synthetic":
        return _synthetic(info)
    if name == "fashion-mnist":
        if download:
            raise UsageError(f"{param('download')} is not available for fashion-mnist: install Debian's "
                             f"dataset-fashion-mnist, or put the original files in {param('data_dir')}")
        return _fashion_mnist(info, data_dir)
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if name == "imagefolder":
        if download:
            raise UsageError(f"{param('download')} is not available for imagefolder; point {param('data_dir')} "
                             "at train/ and val/")
        return _imagefolder(info, root, image_size)
    return _torchvision(info, root, download)


def check_files(name: str, data_dir: Union[str, os.PathLike, None] = None, download: bool = False) -> None:
    """The cheap part of :func:`load_dataset`: whether ``name``'s files are where it would read
    them (nothing is read or downloaded); the same :class:`UsageError` it would raise when they are
    not. A grid checks each dataset once this way before it launches its runs."""
    info = dataset_info(name)
    if info.name in ("mnist1d", "digits", "synthetic"):
        return
    if info.name == "fashion-mnist":
        if not download:
            fashion_files(data_dir)
        return
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if root.exists() and not root.is_dir():
        raise UsageError(f"{param('data_dir')} {root} is a file, not a directory")
    if info.name == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise UsageError(f"imagefolder: {root / split} is not a directory; expected the ImageNet layout "
                                 f"{root}/train/<class>/<image> and {root}/val/<class>/<image>")
        return
    if download or info.name not in _EXPECTED:
        return
    sub, files, _ = _EXPECTED[info.name]
    where = root / sub if sub else root
    missing = [f for f in files if not (where / f).is_file()]
    if missing:
        raise UsageError(_expected_message(info.name, root, missing))


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    """scikit-learn's digits as ``(images uint8 [n, 8, 8], labels int64, train index, test index)``,
    read and split once per process (its reader and splitter cost tens of milliseconds a call, and a
    process such as a grid's report reads the set many times); read-only, so no caller changes them."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise StructinitError("the digits dataset comes with scikit-learn: pip install scikit-learn") from None

    d = load_digits()
    idx = np.arange(len(d.target))
    tr, te = train_test_split(idx, test_size=DIGITS_TEST, random_state=0, stratify=d.target)
    out = (np.round(d.images * (255.0 / 16.0)).astype(np.uint8), d.target.astype(np.int64), np.sort(tr), np.sort(te))
    for a in out:
        a.setflags(write=False)
    return out


def _digits(info: DatasetInfo) -> Data:
    import torch

    images, labels, tr, te = _digits_arrays()
    images = torch.tensor(images).unsqueeze(1)  # copies: the tensors are the caller's to change
    labels = torch.tensor(labels)
    tr, te = torch.from_numpy(tr.copy()), torch.from_numpy(te.copy())
    return Data(info, TensorSplit(images[tr], labels[tr]), TensorSplit(images[te], labels[te]),
                [str(i) for i in range(10)])


def synthetic_images(n: int, seed: int):
    """``n`` 8x8 one-channel images of a bar (class 0 horizontal, 1 vertical, 2 diagonal, 3 anti-diagonal)
    at a random place, on uniform noise: uint8 ``[n, 1, 8, 8]`` and labels ``[n]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    img = torch.rand(n, 8, 8, generator=g) * 0.5
    pos = torch.randint(1, 7, (n,), generator=g)
    ar = torch.arange(8)
    for i in range(n):
        c, p = int(labels[i]), int(pos[i])
        if c == 0:
            img[i, p, :] += 0.5
        elif c == 1:
            img[i, :, p] += 0.5
        elif c == 2:
            img[i, ar, (ar + p) % 8] += 0.5
        else:
            img[i, ar, (p - ar) % 8] += 0.5
    return (img.clamp(0, 1) * 255).round().to(torch.uint8).unsqueeze(1), labels


def _synthetic(info: DatasetInfo) -> Data:
    n_train, n_test = SYNTHETIC_SIZES
    x, y = synthetic_images(n_train + n_test, seed=1234)
    return Data(info, TensorSplit(x[:n_train], y[:n_train]), TensorSplit(x[n_train:], y[n_train:]),
                ["horizontal", "vertical", "diagonal", "anti-diagonal"])


def mnist1d_arrays(shuffle_seq: bool = False) -> Dict[str, Any]:
    """MNIST-1D as the ``mnist1d`` package makes it: ``make_dataset()`` with ``get_dataset_args()``
    (5000 sequences of 40 values, seed 42, split 4000/1000), ``shuffle_seq`` set as asked. Returns
    its dict (``x``, ``y``, ``x_test``, ``y_test``, ...). The package seeds NumPy's and Python's
    global generators; their state is restored afterwards."""
    import random

    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise StructinitError("the mnist1d dataset comes with the mnist1d package: pip install mnist1d") from None
    args = get_dataset_args()
    args.shuffle_seq = bool(shuffle_seq)
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        return make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _mnist1d(info: DatasetInfo, shuffle_seq: bool) -> Data:
    import torch

    d = mnist1d_arrays(shuffle_seq)

    def split(x, y):
        return TensorSplit(torch.from_numpy(np.asarray(x, dtype=np.float32)).unsqueeze(1),
                           torch.from_numpy(np.asarray(y, dtype=np.int64)))

    return Data(info, split(d["x"], d["y"]), split(d["x_test"], d["y_test"]), [str(i) for i in range(10)])


def read_idx(path: Path, magic: int, dims: int):
    """The array in an IDX file (gzipped when its name ends in ``.gz``): big-endian ``magic`` (2051 for
    uint8 images, 2049 for uint8 labels), ``dims`` big-endian sizes, then the bytes. A wrong magic
    number, a file shorter or longer than its sizes say, or one that is not gzip when named so is a
    :class:`UsageError` naming the file."""
    import gzip
    import zlib

    from structinit.atomic import NotRegularFile, read_regular

    try:
        raw = read_regular(path)  # a FIFO or a device in the data folder: refused, not waited on
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except NotRegularFile as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    except (OSError, EOFError, zlib.error) as exc:  # gzip raises BadGzipFile (an OSError), EOFError, zlib errors
        raise UsageError(f"{path}: not a readable IDX file ({exc})") from None
    head = 4 * (1 + dims)
    if len(raw) < head:
        raise UsageError(f"{path}: truncated: {len(raw)} bytes, shorter than an IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise UsageError(f"{path}: magic number {found}, expected {magic} (an IDX file of "
                         f"{'images' if magic == 2051 else 'labels'})")
    sizes = [int.from_bytes(raw[4 * (i + 1):4 * (i + 2)], "big") for i in range(dims)]
    want = int(np.prod(sizes))
    if len(raw) - head != want:
        raise UsageError(f"{path}: {len(raw) - head} bytes of data, but its header says {'x'.join(map(str, sizes))} "
                         f"= {want} ({'truncated' if len(raw) - head < want else 'extra bytes'})")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(sizes)


def fashion_files(data_dir: Union[str, os.PathLike, None] = None) -> Dict[str, Path]:
    """The four Fashion-MNIST files, gzipped or not: in ``data_dir`` (or its ``fashion-mnist``
    folder) when given, else where Debian's ``dataset-fashion-mnist`` puts them. A missing file is a
    :class:`UsageError` that says how to get them."""
    if data_dir is not None:
        roots = [Path(data_dir), Path(data_dir) / "fashion-mnist"]
        if Path(data_dir).exists() and not Path(data_dir).is_dir():
            raise UsageError(f"{param('data_dir')} {data_dir} is a file, not a directory")
    else:
        roots = [FASHION_SYSTEM_DIR]
    found: Dict[str, Path] = {}
    for split in ("train", "test"):
        for kind, stem in zip(("images", "labels"), FASHION_FILES[split]):
            hits = [r / (stem + ext) for r in roots for ext in (".gz", "") if (r / (stem + ext)).is_file()]
            if not hits:
                where = " or ".join(str(r) for r in roots)
                raise UsageError(f"fashion-mnist: {stem}(.gz) not found in {where}. Install Debian's package "
                                 f"(apt-get install dataset-fashion-mnist), or put the original files "
                                 f"(train-images-idx3-ubyte.gz, ...) in a folder given as {param('data_dir')}")
            found[f"{split}_{kind}"] = hits[0]
    return found


def _fashion_mnist(info: DatasetInfo, data_dir) -> Data:
    import torch

    files = fashion_files(data_dir)
    splits = {}
    for split in ("train", "test"):
        x = read_idx(files[f"{split}_images"], 2051, 3)
        y = read_idx(files[f"{split}_labels"], 2049, 1)
        if x.shape[0] != y.shape[0]:
            raise UsageError(f"fashion-mnist: {files[f'{split}_images'].name} has {x.shape[0]} images but "
                             f"{files[f'{split}_labels'].name} has {y.shape[0]} labels")
        if x.shape[1:] != (28, 28):
            raise UsageError(f"fashion-mnist: {files[f'{split}_images'].name} holds {x.shape[1]}x{x.shape[2]} images, "
                             "not 28x28")
        if y.size and int(y.max()) >= 10:
            raise UsageError(f"fashion-mnist: {files[f'{split}_labels'].name} has label {int(y.max())}; the classes "
                             "are 0-9")
        splits[split] = TensorSplit(torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64)))
    return Data(info, splits["train"], splits["test"], list(FASHION_CLASSES))


def _expected_message(name: str, root: Path, missing) -> str:
    sub, files, source = _EXPECTED[name]
    where = root / sub if sub else root
    return (f"{name}: expected torchvision's files {', '.join(files)} in {where}; missing: {', '.join(missing)}. "
            f"Pass {param('data_dir')} DIR holding them, {param('download')} on a machine that is online, or get "
            f"{source} and extract it into {root}")


def _torchvision(info: DatasetInfo, root: Path, download: bool) -> Data:
    import numpy as np
    import torch

    name = info.name
    sub, files, _ = _EXPECTED[name]
    where = root / sub if sub else root
    if root.exists() and not root.is_dir():
        raise UsageError(f"{param('data_dir')} {root} is a file, not a directory")
    if not download:
        missing = [f for f in files if not (where / f).is_file()]
        if missing:
            raise UsageError(_expected_message(name, root, missing))
    import torchvision.datasets as tvd

    if name == "svhn":
        try:
            import scipy.io  # noqa: F401  (torchvision reads SVHN's .mat files with it)
        except ImportError:
            raise StructinitError("svhn needs scipy to read its .mat files: pip install scipy") from None
    try:
        if name == "svhn":
            tr = tvd.SVHN(str(root), split="train", download=download)
            te = tvd.SVHN(str(root), split="test", download=download)
            tr_x, te_x = torch.from_numpy(tr.data), torch.from_numpy(te.data)  # [N, 3, 32, 32]
            tr_y, te_y = tr.labels, te.labels
            classes = [str(i) for i in range(10)]
        else:
            cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
            tr = cls(str(root), train=True, download=download)
            te = cls(str(root), train=False, download=download)
            tr_x = torch.from_numpy(tr.data).permute(0, 3, 1, 2).contiguous()  # [N, 32, 32, 3] -> NCHW
            te_x = torch.from_numpy(te.data).permute(0, 3, 1, 2).contiguous()
            tr_y, te_y = tr.targets, te.targets
            classes = list(tr.classes)
    except (RuntimeError, OSError, ValueError, KeyError, EOFError) as exc:
        if download:
            raise StructinitError(f"{name}: could not download into {root}: {exc}") from None
        raise UsageError(f"{name}: the files in {where} are there but unreadable or corrupt ({exc}); "
                         f"expected torchvision's {', '.join(files)}") from None
    except Exception as exc:  # unpickling garbage raises many kinds
        raise UsageError(f"{name}: the files in {where} are unreadable or corrupt ({type(exc).__name__}: {exc}); "
                         f"expected torchvision's {', '.join(files)}") from None
    return Data(info, TensorSplit(tr_x, torch.as_tensor(np.asarray(tr_y), dtype=torch.int64)),
                TensorSplit(te_x, torch.as_tensor(np.asarray(te_y), dtype=torch.int64)), classes)


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _imagefolder(info: DatasetInfo, root: Path, image_size: Optional[int]) -> Data:
    size = int(image_size or info.image_size)
    layout = (f"expected the ImageNet layout {root}/train/<class>/<image> and {root}/val/<class>/<image> "
              f"(the same class folders in both)")
    splits = {}
    for split in ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise UsageError(f"imagefolder: {d} is not a directory; {layout}")
        classes = sorted(p.name for p in d.iterdir() if p.is_dir())
        if not classes:
            raise UsageError(f"imagefolder: {d} has no class folders; {layout}")
        splits[split] = classes
    if splits["train"] != splits["val"]:
        only = sorted(set(splits["train"]) ^ set(splits["val"]))
        raise UsageError(f"imagefolder: train/ and val/ have different class folders (e.g. {', '.join(only[:5])}); "
                         f"{layout}")
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    norm = T.Normalize(info.mean, info.std)
    train_tf = T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(),
                          T.RandAugment(2, 9), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize(int(round(size / 0.875)), antialias=True), T.CenterCrop(size), T.ToTensor(),
                         norm])
    try:
        train = ImageFolder(str(root / "train"), transform=train_tf, is_valid_file=_is_image)
        test = ImageFolder(str(root / "val"), transform=test_tf, is_valid_file=_is_image)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"imagefolder: {exc}; {layout}") from None
    info = DatasetInfo(info.name, len(splits["train"]), size, 3, info.mean, info.std,
                       info.default_patch, info.hflip, info.augment, in_memory=False)
    return Data(info, train, test, splits["train"])


def _is_image(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS)
