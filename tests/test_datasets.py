"""Datasets: the real digits split, the synthetic set, image folders, clear errors for bad paths."""

import numpy as np
import pytest
import torch
from conftest import error_line

from structinit.errors import UsageError
from structinit.training.augment import BatchAugment, hflip, normalize, random_crop
from structinit.training.datasets import DATASETS, load_dataset, synthetic_images


def test_digits_fixed_split():
    a = load_dataset("digits")
    b = load_dataset("digits")
    assert a.train.images.shape == (1437, 1, 8, 8) and a.test.images.shape == (360, 1, 8, 8)
    assert a.train.images.dtype == torch.uint8 and a.train.labels.dtype == torch.int64
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.test.labels, b.test.labels)
    # Stratified: every class is in the test split with 35 or 36 images.
    counts = torch.bincount(a.test.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    # The 17 grey levels of scikit-learn's digits survive the uint8 encoding exactly.
    assert len(torch.unique(a.train.images)) == 17 and int(a.train.images.max()) == 255
    x = normalize(a.train.images, DATASETS["digits"].mean, DATASETS["digits"].std)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01


def test_synthetic_is_seeded_and_labelled():
    data = load_dataset("synthetic")
    assert data.info.num_classes == 4 and data.train.images.shape == (512, 1, 8, 8)
    x1, y1 = synthetic_images(16, seed=3)
    x2, y2 = synthetic_images(16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # Class 0 is a horizontal bar: one row much brighter than the rest.
    img = x1[y1 == 0][0, 0].float()
    assert img.mean(1).max() - img.mean(1).median() > 80


@pytest.mark.parametrize("name,expect", [
    ("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"), ("svhn", "train_32x32.mat")])
def test_missing_dataset_dir_says_what_and_where(tmp_path, name, expect):
    with pytest.raises(UsageError) as err:
        load_dataset(name, tmp_path / "nowhere")
    msg = str(err.value)
    assert expect in msg and str(tmp_path / "nowhere") in msg and "download" in msg and "data_dir" in msg


def test_malformed_cifar_is_reported_not_crashed(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for f in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
              "batches.meta"):
        (d / f).write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="unreadable or corrupt"):
        load_dataset("cifar10", tmp_path)


def test_data_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        load_dataset("svhn", f)


def _png(path, colour):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 12), colour).save(path)


def test_imagefolder_layout(tmp_path):
    for split in ("train", "val"):
        for i, cls in enumerate(("cat", "dog")):
            for j in range(2):
                _png(tmp_path / split / cls / f"{j}.png", (100 * i, 50, 20 * j))
    data = load_dataset("imagefolder", tmp_path, image_size=16)
    assert data.info.num_classes == 2 and data.classes == ["cat", "dog"] and data.info.image_size == 16
    x, y = data.test[3]
    assert x.shape == (3, 16, 16) and y == 1
    assert len(data.train) == 4


def test_imagefolder_errors(tmp_path):
    with pytest.raises(UsageError, match="train/<class>/<image>"):
        load_dataset("imagefolder", tmp_path)
    _png(tmp_path / "train" / "a" / "0.png", (0, 0, 0))
    _png(tmp_path / "val" / "b" / "0.png", (0, 0, 0))
    with pytest.raises(UsageError, match="different class folders"):
        load_dataset("imagefolder", tmp_path)
    with pytest.raises(UsageError, match="download is not available"):
        load_dataset("imagefolder", tmp_path, download=True)


def test_unknown_dataset():
    with pytest.raises(UsageError, match="unknown dataset"):
        load_dataset("mnist")


def test_batch_augment_is_per_image():
    torch.manual_seed(0)
    x = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8).repeat(32, 3, 1, 1)
    flipped = hflip(x)
    same = (flipped == x).flatten(1).all(1)
    assert 0 < int(same.sum()) < 32  # some images flipped, some not
    cropped = random_crop(x, 2)
    assert cropped.shape == x.shape and len({c.numpy().tobytes() for c in cropped}) > 5
    for kind in ("randaugment", "crop-flip", "flip", "shift", "none"):
        y = BatchAugment(kind)(x)
        assert y.shape == x.shape and y.dtype == torch.uint8
    assert torch.equal(BatchAugment("none")(x), x)
    with pytest.raises(UsageError):
        BatchAugment("mixup")
    n = normalize(x, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert n.dtype == torch.float32 and np.isclose(float(n[0, 0, 0, 0]), -2.0)


def test_shift_moves_each_image_up_to_two_pixels_and_never_flips():
    """``shift`` is the plain loop's augmentation: each image a copy of itself moved by at most
    SHIFT_PIXELS rows and columns (zeros come in), never mirrored, and the shifts vary."""
    torch.manual_seed(1)
    base = torch.randint(1, 256, (1, 1, 8, 8), dtype=torch.uint8)
    x = base.repeat(64, 1, 1, 1)
    y = BatchAugment("shift", flip=True)(x)
    assert y.shape == x.shape and y.dtype == torch.uint8
    padded = torch.nn.functional.pad(base[0, 0], (4, 4, 4, 4))
    moves = set()
    for img in y[:, 0]:
        found = [(dy, dx) for dy in range(-4, 5) for dx in range(-4, 5)
                 if torch.equal(img, padded[4 + dy:12 + dy, 4 + dx:12 + dx])]
        assert len(found) == 1, "every image is its original moved, not mirrored"
        moves.add(found[0])
    assert max(max(abs(dy), abs(dx)) for dy, dx in moves) == 2
    assert len(moves) > 10  # of the 25 shifts, most are drawn in 64 images


def test_cli_bad_data_dir_is_one_error_line(cli, tmp_path):
    r = cli("train", "--model", "vit-t", "--dataset", "cifar10", "--data-dir", tmp_path / "none", "--epochs", "1")
    assert r.returncode == 2
    assert error_line(r.stderr).startswith("error: cifar10: expected")


def test_augment_help_default_names_every_dataset_with_its_own_kind():
    """``train --help``'s default for ``--augment`` is read from the datasets: every dataset whose
    augmentation is not the common one is named beside its kind (fashion-mnist: crop-flip)."""
    from structinit.cli.train import augment_default
    from structinit.training.datasets import DATASETS

    text = augment_default()
    common, *others = text.split("; ")
    named = {}
    for part in others:
        kind, names = part.split(" on ")
        for n in names.split(", "):
            named[n] = kind
    for name, info in DATASETS.items():
        assert named.get(name, common) == info.augment, name
    assert named["fashion-mnist"] == "crop-flip" and common == "randaugment"
