"""A training run's folder and the files in it, message by message: refusals of folder names, what
an unstarted run leaves behind (nothing, however deep the folders it made), the epoch-0 record
left out of the metrics, and the reasons an unreadable or foreign checkpoint gives."""

import argparse
import os

import pytest
import torch
from conftest import says

from structinit.errors import StructinitError, UsageError
from structinit.training.run_checkpoint import _unreadable
from structinit.training.rundir import RunDir, load_run_weights, load_train_checkpoint


@pytest.mark.parametrize("name", ["", "   "])
def test_a_run_folder_needs_a_name(name):
    with pytest.raises(UsageError) as e:
        RunDir(name)
    assert str(e.value).replace("\x1f", "") == "out needs a folder name"


def test_an_unstarted_run_removes_every_folder_it_made_and_only_once(tmp_path):
    run = RunDir(tmp_path / "a" / "b" / "c")
    run.create()
    assert run.created == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    run.write_config({"lr": 0.1})
    run.append_metrics({"epoch": 0, "val_acc": 0.1})
    run.discard_unstarted()
    assert not (tmp_path / "a").exists()

    kept = RunDir(tmp_path / "x" / "y")
    kept.create()
    (tmp_path / "x" / "notes.txt").write_text("mine")  # the user's: x is kept, y (empty) is not
    kept.write_config({"lr": 0.1})
    kept.discard_unstarted()
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["notes.txt"]
    kept.path.mkdir()
    kept.write_config({"another": "run"})  # written after the discard: not this run's
    kept.discard_unstarted()
    assert kept.read_config() == {"another": "run"}


def test_the_metrics_leave_out_the_init_record_and_a_torn_line(tmp_path):
    run = RunDir(tmp_path)
    run.write_metrics([{"epoch": 0, "val_acc": 0.1}, {"epoch": 1, "val_acc": 0.5}])
    with open(run.file(run.METRICS), "a") as f:
        f.write('{"epoch": 2, "val_a')
    assert run.read_metrics() == [{"epoch": 1, "val_acc": 0.5}]


def run_checkpoint(path, **entries):
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3, "args": {"lr": 0.1}, **entries}, path)
    return path


def test_run_weights_are_read_where_asked_and_never_by_running_code(tmp_path, monkeypatch):
    path = run_checkpoint(tmp_path / "best.pt")
    assert load_run_weights(path, map_location="meta")["state_dict"]["w"].is_meta
    timm_style = tmp_path / "timm.pth"  # timm's train.py keeps its settings as an argparse Namespace
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3, "args": argparse.Namespace(lr=0.1)}, timm_style)
    # Even where the environment asks torch.load to unpickle anything unless told otherwise.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(StructinitError) as e:
        load_run_weights(timm_style)
    assert says(str(e.value), f"cannot read checkpoint {timm_style}", "code beyond tensors", "nothing of it was run")


@pytest.mark.parametrize("obj", [
    {"state_dict": {"w": torch.ones(2)}, "epoch": 3},                     # no settings: a foreign checkpoint
    {"state_dict": {"w": torch.ones(2)}, "epoch": 3, "args": "lr=0.1"},  # settings that are not a map
    {"state_dict": {"w": torch.ones(2)}, "args": {"lr": 0.1}},           # no epoch
    {"model": {"w": torch.ones(2)}, "epoch": 3, "args": {"lr": 0.1}},    # weights under another name
    [torch.ones(2)],
])
def test_a_checkpoint_train_did_not_write_is_refused(tmp_path, obj):
    path = tmp_path / "other.pt"
    torch.save(obj, path)
    with pytest.raises(UsageError) as e:
        load_run_weights(path)
    assert says(str(e.value), str(path), "not a checkpoint written by structinit train", "checkpoint.pt or best.pt")


def test_an_unreadable_checkpoint_says_why_in_one_line(tmp_path):
    whole = run_checkpoint(tmp_path / "whole.pt").read_bytes()
    torch.save({"epoch": 1}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    legacy = (tmp_path / "legacy.pt").read_bytes()
    truncated = "not a torch checkpoint, or truncated"
    cases = {b"this is not a checkpoint": truncated, b"": truncated,
             legacy[:len(legacy) // 2]: truncated, b"\x80\x02abc": truncated,  # pickles that end early
             b"\x80\x02\xff\xff": truncated,  # a pickle header, then no pickle
             whole[:len(whole) // 2]: truncated, whole[:10]: truncated}  # torch.save zips cut short
    path = tmp_path / "c.pt"
    for content, why in cases.items():
        path.write_bytes(content)
        for load in (load_run_weights, load_train_checkpoint):
            with pytest.raises(StructinitError) as e:
                load(path)
            assert str(e.value) == f"cannot read checkpoint {path}: {why}", content
    folder = tmp_path / ("d" * 220)
    folder.mkdir()
    with pytest.raises(StructinitError) as e:
        load_run_weights(folder)
    assert str(e.value) == f"cannot read checkpoint {folder}: a folder, not a regular file"
    os.mkfifo(tmp_path / "fifo.pt")  # read through the checked reader: refused, not waited on
    for load in (load_run_weights, load_train_checkpoint):
        with pytest.raises(StructinitError) as e:
            load(tmp_path / "fifo.pt")
        assert str(e.value) == f"cannot read checkpoint {tmp_path / 'fifo.pt'}: a FIFO (named pipe), not a regular file"
    assert _unreadable(RuntimeError("\n first line\nsecond")) == "RuntimeError: first line"
    assert _unreadable(RuntimeError()) == "RuntimeError"
    assert _unreadable(EOFError()) == "not a torch checkpoint, or truncated"
