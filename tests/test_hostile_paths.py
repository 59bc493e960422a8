"""What is read from a path is a regular file of a known size, and what it holds is checked against
what it claims (issue 45): a FIFO, a device or a link to nothing where an artifact, a checkpoint or
a config belongs is named in one line (and in the cache set aside and computed again), never read
until it ends or blocked on; an artifact whose Q/K were edited with both checksums made again is
named for what it is; a cache folder that is a file names who chose it."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_line, feeding_fifo, says, vit_digits

from structinit.errors import ArtifactError, UsageError
from structinit.init.initialize import initialize_model
from structinit.solver.artifact import _checksum, _header_checksum, read_artifact
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CFG = SolveConfig(grid=(4, 4), dim=16, heads=2)  # a shape the package does not ship: solved into the user cache
FIT = dict(data_fit=10, filter=5, data_fit_samples=16)  # its plain solve is not shipped either


def _forged(path: Path, scale: float = 3.0) -> bytes:
    """The artifact at ``path`` with its q scaled by ``scale`` and both checksums made again: whole and
    consistent as a file, not what was solved."""
    from safetensors.numpy import load, save

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    tensors = load(raw)
    tensors["q"] = tensors["q"] * np.float32(scale)
    meta["checksum"] = _checksum(tensors)
    meta["header_checksum"] = _header_checksum(meta)
    return save(tensors, metadata=meta)


def _warned(recwarn):
    return [str(w.message) for w in recwarn.list]


# --------------------------------------------------------------------------- the cache


def test_a_fifo_at_a_fitted_artifacts_name_is_set_aside_and_fitted_again(cache_dir, recwarn):
    """Issue 45: `apply` blocked after "solving" on a FIFO where the fitted artifact belongs. Nothing
    is read from it: it is named, set aside (kept) and the fit runs again."""
    first = initialize_model(vit_digits(), "impulse", **FIT)
    path = Path(first["data_fit"]["artifact"]["path"])
    good = path.read_bytes()
    path.unlink()
    with feeding_fifo(path, good):  # a read of it would get the old artifact, and pass as a cache hit
        again = initialize_model(vit_digits(), "impulse", **FIT)
        moved = path.with_name(path.name + ".set-aside")
        assert moved.is_fifo() and path.is_file()
    said = [w for w in _warned(recwarn) if "ignoring" in w]
    assert said == [f"ignoring unusable artifact: {path}: a FIFO (named pipe), not a regular file; set aside as "
                    f"{moved.name}; it will be recomputed"]
    assert again["data_fit"]["artifact"]["cached"] is False
    assert again["data_fit"]["artifact"]["key"] == first["data_fit"]["artifact"]["key"]
    assert read_artifact(path).key == first["data_fit"]["artifact"]["key"]


@pytest.mark.parametrize("kind", ["device", "dangling"])
def test_a_link_to_a_device_or_to_nothing_in_the_cache_is_set_aside_and_solved_again(cache_dir, kind):
    """A link to /dev/zero was read until memory ran out; a link to nothing was "no such file". A
    link to /dev/null (a character device whose read ends at once, so the old reader called it
    corrupt, not what it is) stands for both devices here."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / CFG.filename
    target = "/dev/null" if kind == "device" else str(cache_dir / "gone.safetensors")
    os.symlink(target, path)
    warnings = []
    res = solve(CFG, cache_dir=cache_dir, warn=warnings.append)
    moved = path.with_name(path.name + ".set-aside")
    what = ("character device", "not a regular file") if kind == "device" else ("symbolic link", target,
                                                                                 "does not exist")
    assert len(warnings) == 1 and says(warnings[0], "unusable artifact", str(path), *what, moved.name, "recomputed")
    assert not res.cached and path.is_file() and not path.is_symlink()
    assert moved.is_symlink() and os.readlink(moved) == target  # kept as it was, for a person to look at


def test_inspect_names_a_fifo_in_the_cache_and_reads_nothing_from_it(cache_dir, cli):
    """`inspect` of a FIFO, by path and in the cache listing, says what it is."""
    res = solve(CFG, cache_dir=cache_dir)
    fifo = cache_dir / ("n16-d16-h2-f3-fit-" + "0" * 12 + ".safetensors")
    with feeding_fifo(fifo, res.artifact.path.read_bytes()):
        r = cli("inspect", fifo)
        assert r.returncode == 2 and says(error_line(r.stderr), str(fifo), "FIFO", "not a regular file")
        r = cli("inspect", "--json")
        assert r.returncode == 0, r.stderr
        listed = {Path(a["path"]).name: a for a in json.loads(r.stdout)["artifacts"]}
        assert listed[fifo.name] == {"path": str(fifo), "ok": False,
                                     "error": f"{fifo}: a FIFO (named pipe), not a regular file"}
        assert listed[CFG.filename]["ok"] is True
        assert fifo.is_fifo()  # inspect only reads: nothing is set aside


def test_an_artifact_whose_header_promises_another_size_is_refused_before_it_is_read(tmp_path):
    res = solve(CFG, cache_dir=tmp_path)
    raw = res.artifact.path.read_bytes()
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(raw + b"\0" * 64)  # bytes past its tensors: not what was written
    with pytest.raises(ArtifactError) as e:
        read_artifact(longer)
    assert says(str(e.value), str(longer), "not a readable safetensors file", f"end at byte {len(raw)}",
                f"the file has {len(raw) + 64}")
    promised = tmp_path / "promised.safetensors"
    promised.write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])
    with pytest.raises(ArtifactError) as e:
        read_artifact(promised)
    assert says(str(e.value), str(promised), f"{len(raw)}-byte file", f"header of {len(raw) * 2} bytes")


# --------------------------------------------------------------------------- forged Q/K


def test_a_forged_artifact_in_the_cache_is_named_set_aside_and_solved_again(cache_dir, cli, tmp_path):
    """Issue 45: q x3 with both checksums made again passed every check; `apply` then stopped with
    "the Q/K rows were not placed as the layout expects", naming no file, and every later run did the
    same. Now the cached copy is named, set aside, and solved again; the apply succeeds."""
    torch.save(vit_digits().state_dict(), tmp_path / "vit.pt")
    args = ("apply", tmp_path / "vit.pt", "--heads", "4", "--data-fit", "0", "--filter", "5", "--json")
    first = json.loads(cli(*args, "--out", tmp_path / "a.pt").stdout)
    path = Path(first["artifact"]["path"])
    assert path.parent == cache_dir
    path.write_bytes(_forged(path))
    read_artifact(path)  # whole and consistent as a file
    r = cli(*args, "--out", tmp_path / "b.pt")
    assert r.returncode == 0, r.stderr
    moved = path.with_name(path.name + ".set-aside")
    assert [line for line in r.stderr.splitlines() if line.startswith("warning:")] == [
        f"warning: ignoring unusable artifact: {path}: its Q/K give head 0 of layer 0 a target mass of "
        f"{_forged_mass(moved)} on its own pseudo input, and its stats record 0.300: the tensors are not the ones that "
        f"were solved (edited, with its checksums made again); set aside as {moved.name}; it will be recomputed"]
    again = json.loads(r.stdout)
    assert again["artifact"]["cached"] is False and again["layers"] == first["layers"]
    assert torch.equal(torch.load(tmp_path / "b.pt")["blocks.0.attn.qkv.weight"],
                       torch.load(tmp_path / "a.pt")["blocks.0.attn.qkv.weight"])


def _forged_mass(path) -> str:
    from structinit.geometry.targets import impulse_columns
    from structinit.solver.artifact import head_target_masses

    art = read_artifact(path)
    columns = impulse_columns(art.config.grid, art.offsets[0])
    got = head_target_masses(art.layer_input(0), art.q[0], art.k[0], columns)[0]
    assert abs(got - 0.3) > 0.1  # far from what was solved
    return f"{got:.3f}"


def test_a_forged_artifact_given_by_the_user_is_refused_naming_it_and_kept(cache_dir, cli, tmp_path):
    res = solve(CFG, cache_dir=cache_dir)
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(_forged(res.artifact.path, scale=0.1))
    before = mine.read_bytes()
    from structinit.solver.cache import resolve_artifact

    with pytest.raises(ArtifactError) as e:
        resolve_artifact(mine)
    assert str(e.value).startswith(f"{mine}: its Q/K give head 0 of layer 0 a target mass of ") \
        and "were solved" in str(e.value)
    torch.save(vit_digits().state_dict(), tmp_path / "vit.pt")
    r = cli("apply", tmp_path / "vit.pt", "--heads", "4", "--artifact", mine, "--set-pe", "sincos", "--out",
            tmp_path / "o.pt")
    assert r.returncode == 1 and error_line(r.stderr) == f"error: {e.value}"
    assert mine.read_bytes() == before and not (tmp_path / "o.pt").exists()  # the user's file is theirs


# --------------------------------------------------------------------------- checkpoints and configs


def test_a_fifo_a_device_or_a_link_to_nothing_as_the_checkpoint_is_one_line(tmp_path, cli):
    """Issue 45: `apply some.fifo` blocked; /dev/zero was "the file is empty"."""
    zero = tmp_path / "zero.pt"
    os.symlink("/dev/zero", zero)
    r = cli("apply", zero, "--heads", "4")  # exit 2: a path that names no usable file (the README's rule)
    assert r.returncode == 2 and says(error_line(r.stderr), str(zero), "character device", "not a regular file")
    r = cli("apply", "/dev/zero", "--heads", "4", "--out", tmp_path / "o.pt")
    assert r.returncode == 2 and says(error_line(r.stderr), "/dev/zero", "character device", "not a regular file")
    gone = tmp_path / "gone.pt"
    os.symlink(tmp_path / "nothing.pt", gone)
    r = cli("apply", gone, "--heads", "4")
    assert r.returncode == 2
    assert says(error_line(r.stderr), str(gone), "symbolic link", str(tmp_path / "nothing.pt"), "does not exist")
    fifo = tmp_path / "some.fifo"
    with feeding_fifo(fifo, b"PK\x03\x04 not a zip"):
        for args in (("apply", fifo, "--heads", "4"), ("inspect", fifo, "--heads", "4")):
            r = cli(*args)
            assert r.returncode == 2
            assert says(error_line(r.stderr), str(fifo), "FIFO", "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone.pt", "some.fifo", "zero.pt"]  # nothing written


def test_a_fifo_at_a_hugging_face_config_is_not_read(tmp_path):
    """The config.json beside a Hugging Face checkpoint tells its heads; a FIFO there tells nothing."""
    from structinit.init.checkpoints import load_checkpoint

    d = 32
    sd = {"embeddings.position_embeddings": torch.randn(1, 17, d), "embeddings.cls_token": torch.zeros(1, 1, d)}
    for i in range(2):
        for part in ("query", "key", "value"):
            sd[f"encoder.layer.{i}.attention.attention.{part}.weight"] = torch.randn(d, d)
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "model.safetensors")
    with feeding_fifo(tmp_path / "config.json", json.dumps({"num_attention_heads": 4, "hidden_size": d}).encode()):
        ckpt = load_checkpoint(tmp_path / "model.safetensors")
    assert ckpt.detected.heads is None and "config.json" not in ckpt.extra


def test_a_cache_folder_that_is_a_file_names_who_chose_it(tmp_path, cli, monkeypatch):
    """Issue 45: with $STRUCTINIT_CACHE at a file the error blamed --cache-dir, never given."""
    from structinit.solver.cache import check_cache_dir

    taken = tmp_path / "file"
    taken.write_text("not a folder")
    monkeypatch.setenv("STRUCTINIT_CACHE", str(taken))
    with pytest.raises(UsageError) as e:
        check_cache_dir(None)
    assert says(str(e.value), f"$STRUCTINIT_CACHE {taken}", "not a folder")
    r = cli("solve", "--grid", "4x4", "--dim", "16", "--heads", "2")
    line = error_line(r.stderr)
    assert r.returncode == 2 and says(line, f"$STRUCTINIT_CACHE {taken}", "not a folder") and "--cache-dir" not in line
    r = cli("solve", "--grid", "4x4", "--dim", "16", "--heads", "2", "--cache-dir", taken)
    line = error_line(r.stderr)
    assert r.returncode == 2 and says(line, f"--cache-dir {taken}", "not a folder") and "$STRUCTINIT_CACHE" not in line
    monkeypatch.setenv("STRUCTINIT_CACHE", str(taken / "sub"))  # below a file: it cannot be made
    r = cli("solve", "--grid", "4x4", "--dim", "16", "--heads", "2")
    assert r.returncode == 1
    assert says(error_line(r.stderr), "cannot create", "$STRUCTINIT_CACHE", str(taken / "sub"), "Not a directory")
    assert taken.read_text() == "not a folder"
