"""Fashion-MNIST from the original IDX files (Debian's dataset-fashion-mnist, which .ci/run
installs; or any folder holding them, gzipped or not): the real 60,000 / 10,000 split, its
normalization, its augmentation, the presets for it, and one line for each kind of broken file."""

import gzip
import shutil

import numpy as np
import pytest
from conftest import error_line, says

from structinit.errors import UsageError
from structinit.training.datasets import DATASETS, FASHION_SYSTEM_DIR, load_dataset, read_idx, split_train

needs_files = pytest.mark.skipif(not (FASHION_SYSTEM_DIR / "train-images-idx3-ubyte.gz").exists(),
                                 reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@pytest.fixture(scope="module")
def fashion():
    return load_dataset("fashion-mnist")


@needs_files
def test_the_original_split_loads_with_its_classes_and_statistics(fashion):
    assert tuple(fashion.train.images.shape) == (60000, 1, 28, 28) and tuple(fashion.test.images.shape) == (10000, 1,
                                                                                                              28, 28)
    assert fashion.train.images.dtype.is_floating_point is False
    # every class 6,000 times in training and 1,000 in test, as the dataset is published
    assert np.bincount(fashion.train.labels.numpy()).tolist() == [6000] * 10
    assert np.bincount(fashion.test.labels.numpy()).tolist() == [1000] * 10
    assert fashion.train.labels[:5].tolist() == [9, 0, 0, 3, 0]  # the files' first labels: ankle boot, T-shirt, ...
    assert fashion.classes[9] == "Ankle boot" and len(fashion.classes) == 10
    info = DATASETS["fashion-mnist"]
    pixels = fashion.train.images.float() / 255
    assert (float(pixels.mean()), float(pixels.std())) == pytest.approx((info.mean[0], info.std[0]), abs=1e-4)
    assert info.default_patch == 4 and info.augment == "crop-flip" and info.hflip


@needs_files
def test_subsets_and_the_validation_split_are_stratified(fashion):
    data = split_train(fashion, 500, 2000, 3)
    assert len(data.train) == 500 and len(data.val) == 2000
    assert np.bincount(data.train.labels.numpy()).tolist() == [50] * 10
    assert np.bincount(data.val.labels.numpy()).tolist() == [200] * 10
    again = split_train(fashion, 500, 2000, 4)
    assert np.array_equal(again.val.labels.numpy(), data.val.labels.numpy())  # the same validation split
    assert not np.array_equal(again.train.images.numpy(), data.train.images.numpy())


@pytest.fixture(scope="module")
def ungzipped(tmp_path_factory):
    """A folder of the four files ungzipped, made once for the module."""
    folder = tmp_path_factory.mktemp("ungzipped")
    for name in FILES:
        with gzip.open(FASHION_SYSTEM_DIR / f"{name}.gz") as src, open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return folder


@needs_files
def test_a_folder_of_the_files_ungzipped_reads_the_same(ungzipped, fashion):
    got = load_dataset("fashion-mnist", ungzipped)
    assert np.array_equal(got.test.images.numpy(), fashion.test.images.numpy())
    assert np.array_equal(got.train.labels.numpy(), fashion.train.labels.numpy())


@pytest.fixture(scope="module")
def originals(ungzipped):
    """The four files' bytes (ungzipped)."""
    return {name: (ungzipped / name).read_bytes() for name in FILES}


def _folder(tmp_path, originals, change, ungzipped):
    """A folder of the four files, changed by ``change(name, bytes)``: a changed file is a copy, an
    unchanged one a link to the module's ungzipped original (60 MB need not be written per case)."""
    for name, raw in originals.items():
        new = change(name, raw)
        if new is raw:
            (tmp_path / name).symlink_to(ungzipped / name)
        elif new is not None:
            (tmp_path / name).write_bytes(new)
    return tmp_path


@needs_files
@pytest.mark.parametrize("change, message", [
    (lambda n, raw: None if n == "t10k-labels-idx1-ubyte" else raw,
     "t10k-labels-idx1-ubyte(.gz) not found in {d} or {d}/fashion-mnist. Install Debian's package "
     "(apt-get install dataset-fashion-mnist)"),
    (lambda n, raw: raw[:100000] if n == "train-images-idx3-ubyte" else raw,
     "train-images-idx3-ubyte: 99984 bytes of data, but its header says 60000x28x28 = 47040000 (truncated)"),
    (lambda n, raw: raw[:6] if n == "train-labels-idx1-ubyte" else raw, "bytes, shorter than an IDX header"),
    (lambda n, raw: (2049).to_bytes(4, "big") + raw[4:] if n == "t10k-images-idx3-ubyte" else raw,
     "t10k-images-idx3-ubyte: magic number 2049, expected 2051 (an IDX file of images)"),
    (lambda n, raw: raw[:8] + raw[8 + 1000:] if n == "t10k-labels-idx1-ubyte" else raw, "truncated"),
    (lambda n, raw: (raw[:4] + (9000).to_bytes(4, "big") + raw[8:8 + 9000]) if n == "t10k-labels-idx1-ubyte" else raw,
     "fashion-mnist: t10k-images-idx3-ubyte has 10000 images but t10k-labels-idx1-ubyte has 9000 labels"),
    (lambda n, raw: raw[:8] + bytes([12]) + raw[9:] if n == "train-labels-idx1-ubyte" else raw,
     "train-labels-idx1-ubyte has label 12; the classes are 0-9"),
])
def test_broken_files_are_one_clear_line(tmp_path, cli, originals, ungzipped, change, message):
    folder = _folder(tmp_path, originals, change, ungzipped)
    with pytest.raises(UsageError) as e:
        load_dataset("fashion-mnist", folder)
    assert message.format(d=folder) in str(e.value)
    r = cli("train", "--model", "vit-fashion", "--dataset", "fashion-mnist", "--data-dir", folder, "--epochs", "1",
            "--train-size", "64", "--out", tmp_path / "run")
    assert r.returncode == 2 and error_line(r.stderr)
    assert not (tmp_path / "run").exists()


def test_a_gzip_file_that_is_not_gzip_is_named(tmp_path):
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(UsageError, match=r"train-images-idx3-ubyte.gz: not a readable IDX file"):
        read_idx(bad, 2051, 3)


def test_where_nothing_is_found_the_error_says_how_to_get_it(tmp_path, cli):
    r = cli("train", "--model", "vit-fashion", "--dataset", "fashion-mnist", "--data-dir", tmp_path, "--epochs", "1")
    assert r.returncode == 2
    assert "apt-get install dataset-fashion-mnist" in r.stderr and "--data-dir" in r.stderr
    r = cli("train", "--model", "vit-fashion", "--dataset", "fashion-mnist", "--download", "--epochs", "1")
    assert r.returncode == 2 and says(error_line(r.stderr), "--download", "not available", "fashion-mnist")


@needs_files
@pytest.mark.slow
def test_the_49_token_preset_trains_on_it_with_the_default_init(tmp_path):
    from structinit.training.config import TrainConfig
    from structinit.training.loop import train

    r = train(TrainConfig(model="vit-fashion", dataset="fashion-mnist", init="impulse", init_params={"data_fit": 20},
                          train_size=64, batch_size=32, epochs=1, val_size=100, out=str(tmp_path / "r"), threads=1))
    rep = r.init_report
    assert rep["grid"] == [7, 7] and rep["data_fit"]["samples"] == 64
    assert r.final_val_acc is not None and r.epochs == 1


@needs_files
def test_the_196_token_preset_gets_the_default_init_on_real_fashion_images(fashion):
    """The patch-2 preset: a 14x14 grid, and the fit runs on the real images (its training loop is the
    49-token one's; evaluating 10,000 test images at 196 tokens costs a minute on one CPU thread)."""
    import warnings

    from structinit.init.initialize import initialize_model
    from structinit.training.augment import normalize
    from structinit.training.models import ModelConfig, build_model

    info = DATASETS["fashion-mnist"]
    model = build_model(ModelConfig("vit-fashion-196"), num_classes=10, image_size=28, in_chans=1,
                        default_patch=info.default_patch, seed=0)
    x = normalize(fashion.train.images[:16], info.mean, info.std)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5 steps leave the fit partly structured, which it says
        rep = initialize_model(model, "impulse", data=x, data_fit=5, seed=0)
    assert rep["grid"] == [14, 14] and rep["data_fit"]["samples"] == 16 and len(rep["data_fit"]["layers"]) == 4
    assert all(len(layer["offsets"]) == 4 for layer in rep["layers"])  # one 3x3 offset per head
