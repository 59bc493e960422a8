"""Hostile input to ``apply``, ``solve`` and the init, round 6 (issue 54): non-finite and integer
weights, damaged data files, options that conflict or would do nothing, silent caps, and refusals
that named the wrong cause. Each case is one ``error:`` line (``conftest.error_line``) with the
documented exit code, or the behaviour the user asked for; nothing is written from a refused input."""

import json
import typing

import pytest
import torch
from conftest import error_line, says
from test_hostile import timm_vit  # a timm ViT of an 8x8 grid, dim 64, 4 heads

DIM, HEADS = 64, 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def refused(r, code=2):
    """The one ``error:`` line of a refused command (exit ``code``, nothing on stdout)."""
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert r.stdout == ""
    return error_line(r.stderr)


# --------------------------------------------------------------------------- the shared --seed flag

def test_the_shared_seed_flag_refuses_a_negative_seed_in_every_command_that_takes_it(cli):
    """Case 22: the lower bound of the one ``--seed`` declaration (cli.common.Seed), which apply now
    takes too instead of a copy of its own."""
    from structinit.cli.apply import apply
    from structinit.cli.common import Seed

    assert typing.get_type_hints(apply, include_extras=True)["seed"] == Seed
    for command in (["bench", "loop"], ["apply", "x.pt"], ["solve"]):
        line = refused(cli(*command, "--seed", "-1"))
        assert "--seed" in line and "greater than or equal to 0" in line, line


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``plain.pt`` (a timm state dict), ``learned.pth`` (a class token and a learned position
    embedding) and ``x.pt``, 300 normalized inputs for them (more than the fit's default 256)."""
    d = tmp_path_factory.mktemp("made")
    torch.save(timm_vit().state_dict(), d / "plain.pt")
    torch.save(timm_vit(class_token=True, learned=True).state_dict(), d / "learned.pth")
    torch.save(torch.randn(300, 3, 16, 16, generator=torch.Generator().manual_seed(0)), d / "x.pt")
    return d


def load_sd(path):
    from structinit.init.checkpoints import load_checkpoint

    return {k: torch.as_tensor(v) for k, v in load_checkpoint(path).state_dicts[0][1].items()}


QUICK = ["-p", "data_fit=2"]


# --------------------------------------------------------------------------- caps and conflicts

def test_samples_above_the_fits_default_are_all_read_by_the_fit(cli, made, tmp_path):
    """Case 3: ``--samples 300``, above the fit's default ``data_fit_samples`` (256): the fit reads the
    300 inputs the report names (its key is the 300-input fit's), never a silent 256; on noise too."""
    from structinit.solver.artifact import read_artifact

    r = cli("apply", made / "plain.pt", "--heads", HEADS, *QUICK, "--data", made / "x.pt", "--samples", "300",
            "--out", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    fitted = read_artifact(report["data_fit"]["artifact"]["path"])
    assert fitted.fit["identity"]["samples"] == 300 and fitted.fit["identity"]["fit"]["data_fit_samples"] == 300
    assert report["params"]["data_fit_samples"] == 300 and "first 300 inputs" in report["data_fit"]["source"]
    noise = cli("apply", made / "plain.pt", "--heads", HEADS, *QUICK, "--data", "noise", "--samples", "300",
                "--out", tmp_path / "n.pt", "--json")
    assert noise.returncode == 0, noise.stderr
    identity = read_artifact(json.loads(noise.stdout)["data_fit"]["artifact"]["path"]).fit["identity"]
    assert identity["inputs"]["kind"] == "noise" and identity["inputs"]["samples"] == 300


@pytest.mark.parametrize("args, want", [
    (["-p", "filter=5", "--filter", "3"], ("--filter 3", "filter=5", "give one")),
    (["-p", "data_fit=100", "--data-fit", "200"], ("--data-fit 200", "data_fit=100", "give one")),
    (["-p", "share=false", "--share"], ("--share", "share=false", "give one")),
    (["-p", "mimetic_vproj=true", "--no-mimetic-vproj"], ("--no-mimetic-vproj", "mimetic_vproj=true", "give one")),
    (["-p", "target_mass=0.3", "-p", "target_mass=0.5"], ("--init-param", "target_mass=0.3", "target_mass=0.5",
                                                          "twice")),
    (["--recipe-param", "iters=20", "--recipe-param", "iters=30"], ("--recipe-param", "iters=20", "iters=30", "twice")),
    (["-p", "data_fit_samples=16", "--data", "noise", "--samples", "40"], ("--samples", "data_fit_samples",
                                                                           "give one")),
])
def test_conflicting_values_are_refused_naming_both(cli, made, tmp_path, args, want):
    """Case 4: a value given twice (a flag and ``-p``, or ``-p`` twice) is refused, naming both; no
    output is written."""
    r = cli("apply", made / "plain.pt", "--heads", HEADS, *args, "--out", tmp_path / "o.pt")
    assert says(refused(r), "error: ", *want)
    assert not (tmp_path / "o.pt").exists()


def test_a_setting_given_twice_is_refused_by_train_too(cli, tmp_path):
    r = cli("train", "--dataset", "digits", "-p", "filter=3", "-p", "filter=5", "--out", tmp_path / "run")
    assert says(refused(r), "--init-param", "filter=3", "filter=5", "twice")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- options that do nothing

@pytest.mark.parametrize("params, want", [
    ({"position_rest": True}, ("position_rest", "position subspace", "off", "position_subspace=true")),
    ({"position_keep_norms": True}, ("position_keep_norms", "position subspace", "off", "position_subspace=True")),
    ({"mimetic_vproj": False, "alpha2": 0.5}, ("alpha2", "V/proj", "mimetic_vproj=False", "mimetic_vproj=True")),
])
def test_a_parameter_that_would_do_nothing_is_refused(params, want):
    """Case 8: ``position_rest`` without the subspace is refused as its sibling ``position_dims`` is;
    so are ``alpha2``/``beta2`` where ``mimetic_vproj=false`` keeps V/proj."""
    from structinit.errors import UsageError
    from structinit.init.registry import init_spec

    with pytest.raises(UsageError) as err:
        init_spec("impulse", **params)
    assert says(err.value.render(), "impulse", *want)
    init_spec("impulse", position_subspace=True, position_rest=True)  # with the subspace: accepted
    init_spec("impulse", mimetic_vproj=False)


@pytest.mark.parametrize("name", ["position_rest", "position_keep_norms"])
def test_a_subspace_parameter_without_the_subspace_is_refused_by_apply(cli, made, tmp_path, name):
    r = cli("apply", made / "plain.pt", "--heads", HEADS, "-p", f"{name}=true", "--out", tmp_path / "o.pt")
    assert says(refused(r), "error: ", name, "position subspace", "off", "position_subspace=true")
    assert not (tmp_path / "o.pt").exists()


# --------------------------------------------------------------------------- wrong causes

@pytest.mark.parametrize("heads", ["-4", "0"])
def test_a_heads_count_below_one_is_refused_for_its_sign(cli, made, tmp_path, heads):
    """Case 17: ``--heads -4`` and ``--heads 0`` are refused for what they are, not for not dividing
    the dim."""
    line = refused(cli("apply", made / "plain.pt", "--heads", heads, "--out", tmp_path / "o.pt"))
    assert says(line, "--heads", "positive integer", f"got {heads}") and "divide" not in line


def test_heads_below_one_are_refused_by_the_library_too(made):
    from structinit.errors import UsageError
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.checkpoints import load_checkpoint

    sd = load_checkpoint(made / "plain.pt").state_dicts[0][1]
    with pytest.raises(UsageError) as e:
        AttentionTarget(sd, None, -4)
    assert says(str(e.value), "heads", "positive integer", "got -4")


def test_a_named_model_whose_heads_cannot_be_the_checkpoints_is_blamed_not_heads(cli, made, tmp_path):
    """Case 18: ``--model vit_tiny_patch16_224`` (3 heads) on a dim-64 checkpoint names the model,
    not a ``--heads 3`` the user never gave."""
    line = refused(cli("apply", made / "plain.pt", "--model", "vit_tiny_patch16_224", "--out", tmp_path / "o.pt"))
    assert says(line, "--model vit_tiny_patch16_224", "3 heads", "do not divide", "dim 64", "--heads")
    assert "--heads 3" not in line  # never given


@pytest.mark.parametrize("args, want", [
    (["--model", ""], ("--model", "empty")),
    (["--grid", ""], ("--grid", "HxW", "got ''")),
    (["--data", "digits", "--data-dir", "."], ("--data-dir", "digits", "needs no files")),
])
def test_empty_names_and_a_data_dir_that_does_nothing_are_refused(cli, made, tmp_path, args, want):
    """Case 18: ``--model ""`` and ``--grid ""`` are refused, not taken as not given; ``--data digits
    --data-dir X`` is refused as ``train`` refuses it."""
    assert says(refused(cli("apply", made / "plain.pt", "--heads", HEADS, *args, "--out", tmp_path / "o.pt")), *want)
    assert not (tmp_path / "o.pt").exists()


def test_inspect_refuses_an_empty_grid_too(cli, made):
    line = refused(cli("inspect", made / "plain.pt", "--heads", HEADS, "--grid", ""))
    assert says(line, "--grid", "HxW", "got ''")


def hf_vit_folder(folder, config_bytes):
    """A one-layer Hugging Face ViT state dict (dim 8) as model.safetensors, with ``config_bytes``
    as its config.json."""
    import safetensors.torch

    d, pre = 8, "encoder.layer.0.attention."
    sd = {pre + f"attention.{n}.{w}": torch.zeros(d, d) if w == "weight" else torch.zeros(d)
          for n in ("query", "key", "value") for w in ("weight", "bias")}
    sd[pre + "output.dense.weight"] = torch.zeros(d, d)
    sd["embeddings.position_embeddings"] = torch.zeros(1, 17, d)
    sd["embeddings.cls_token"] = torch.zeros(1, 1, d)
    folder.mkdir()
    safetensors.torch.save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_bytes(config_bytes)
    return folder


@pytest.mark.parametrize("config, why", [
    (b'{"num_attention_heads": 2, "hidden_', "is not valid JSON"),
    (b"{" + b" " * (17 * 2 ** 20) + b"}", "is not readable: "),
    (b'{"hidden_size": 8}', "names no num_attention_heads"),
])
def test_a_broken_config_json_is_named_as_the_cause(cli, tmp_path, config, why):
    """Case 18: a broken, oversized or headless config.json beside the weights is reported as such,
    not only as a checkpoint that "does not tell its number of heads"."""
    folder = hf_vit_folder(tmp_path / "vit", config)
    line = refused(cli("apply", folder, "--method", "mimetic", "--dry-run"))
    assert line.startswith("error: the hf-vit checkpoint does not tell its number of heads (") and why in line, line
    assert str(folder / "config.json") in line


# --------------------------------------------------------------------------- files that are not what they say

def damaged_files(folder):
    """Files given as ``--data``: a safetensors header claiming [1e10, 1e10, 8, 8], a truncated
    safetensors file, and a 25 KB .npy whose header claims 9,999,999,999,999 rows."""
    import struct

    import numpy as np
    from safetensors.torch import save_file

    header = json.dumps({"inputs": {"dtype": "F32", "shape": [10 ** 10, 10 ** 10, 8, 8],
                                    "data_offsets": [0, 16]}}).encode()
    (folder / "huge.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    save_file({"inputs": torch.randn(20, 3, 16, 16)}, str(folder / "whole.safetensors"))
    whole = (folder / "whole.safetensors").read_bytes()
    (folder / "cut.safetensors").write_bytes(whole[:len(whole) // 2])
    np.save(folder / "whole.npy", np.zeros((20, 3, 16, 16), dtype=np.float32))
    raw = (folder / "whole.npy").read_bytes()
    end = raw.index(b"\n") + 1
    head = raw[:end].replace(b"(20, 3, 16, 16)", b"(9999999999999, 3, 16, 16)")
    head = head[:-1].rstrip() + b" " * (end - len(head[:-1].rstrip()) - 1) + b"\n"  # the header keeps its length
    (folder / "rows.npy").write_bytes(head + raw[end:end + 25_000])
    return folder


@pytest.mark.parametrize("name, why", [
    ("huge.safetensors", "tensor 'inputs' claims shape [10000000000, 10000000000, 8, 8]"),
    ("cut.safetensors", "tensor 'inputs' claims shape [20, 3, 16, 16] (61,440 bytes at 0..61,440); the file holds "
                        "30,"),
    ("rows.npy", "its header promises [9999999999999, 3, 16, 16] float32 values"),
])
def test_a_damaged_data_file_is_one_line_that_says_so(cli, made, tmp_path, name, why):
    """Case 12: a tensor file whose header promises more than the file holds is damaged: one line,
    checked against the file's size before reading (no traceback, no out-of-memory advice), and
    nothing written."""
    damaged_files(tmp_path)
    line = refused(cli("apply", made / "plain.pt", "--heads", HEADS, "--data", tmp_path / name,
                       "--out", tmp_path / "o.pt"))
    assert line.startswith(f"error: --data {tmp_path / name} is damaged: ") and why in line, line
    assert "memory" not in line and not (tmp_path / "o.pt").exists()


def test_a_torch_file_named_safetensors_is_read_as_the_torch_file_it_is(cli, made, tmp_path):
    """Case 15: the format is read from the content, as the docs say, for a checkpoint and for
    ``--data``: a ``torch.save`` file named ``.safetensors`` is not refused as a broken safetensors."""
    from structinit.init.checkpoints import read_object

    torch.save(torch.load(made / "plain.pt"), tmp_path / "vit.safetensors")
    x = torch.load(made / "x.pt")[:20]
    torch.save(x, tmp_path / "inputs.safetensors")
    obj, fmt, _ = read_object(tmp_path / "vit.safetensors")
    assert fmt == "torch" and torch.equal(obj["blocks.0.attn.qkv.weight"],
                                          torch.load(made / "plain.pt")["blocks.0.attn.qkv.weight"])
    r = cli("apply", tmp_path / "vit.safetensors", "--heads", HEADS, *QUICK, "--data", tmp_path / "inputs.safetensors",
            "--out", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data_fit"]["source"].endswith("inputs.safetensors: the first 20 inputs")


# --------------------------------------------------------------------------- non-finite and integer weights

def diverged(made, folder, key, value, index=0):
    """``plain.pt`` with ``value`` (inf, NaN) at flat ``index`` of tensor ``key``, saved in ``folder``."""
    sd = torch.load(made / "plain.pt")
    sd[key].view(-1)[index] = value
    path = folder / f"diverged-{key}.pt"
    torch.save(sd, path)
    return path


@pytest.mark.parametrize("key, value, bad", [
    ("blocks.0.mlp.fc1.weight", float("inf"), "1 inf of its 16,384 values"),
    ("patch_embed.proj.weight", float("nan"), "1 NaN of its 768 values"),
])
def test_a_checkpoint_with_a_non_finite_weight_is_refused_before_any_work(cli, made, tmp_path, cache_dir, key, value,
                                                                          bad):
    """Case 2: a diverged checkpoint (one inf in an MLP, a NaN in the patch embedding) is refused
    naming the tensor and how many values, before any solve or fit: nothing is written or cached."""
    path = diverged(made, tmp_path, key, value)
    line = refused(cli("apply", path, "--heads", HEADS, "--out", tmp_path / "o.pt", "--json"))
    assert says(line, str(path), f"tensor {key} holds {bad}", "finite weights", "nothing was written")
    assert not (tmp_path / "o.pt").exists() and not any(cache_dir.rglob("*.safetensors"))


def test_data_holding_non_finite_values_is_refused_with_the_count(cli, made, tmp_path, cache_dir):
    x = torch.load(made / "x.pt")[:20].clone()
    x[3, 1, 2, 2] = float("nan")
    x[4, 0, 0, 0] = float("-inf")
    torch.save(x, tmp_path / "nan.pt")
    line = refused(cli("apply", made / "plain.pt", "--heads", HEADS, "--data", tmp_path / "nan.pt",
                       "--out", tmp_path / "o.pt"))
    assert says(line, "--data", str(tmp_path / "nan.pt"), "first 20 inputs", "1 NaN and 1 inf of its 15,360",
                "finite inputs")
    assert not (tmp_path / "o.pt").exists() and not any(cache_dir.rglob("*-fit-*.safetensors"))


def test_initialize_model_refuses_non_finite_weights_and_inputs(cache_dir):
    from structinit.errors import UsageError
    from structinit.init.initialize import initialize_model

    model = timm_vit()
    with torch.no_grad():
        model.blocks[1].norm1.weight[3] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError) as e:
        initialize_model(model, "impulse", data_fit=2)
    assert says(str(e.value), "the model", "blocks.1.norm1.weight", "1 NaN of its 64 values")
    unchanged = [torch.equal(before[k], v) for k, v in model.state_dict().items() if k != "blocks.1.norm1.weight"]
    assert all(unchanged)  # the refusal came before any write (the NaN tensor is not equal to itself)
    x = torch.randn(8, 3, 16, 16)
    x[2, 0, 0, 0] = float("inf")
    with pytest.raises(UsageError) as e:
        initialize_model(timm_vit(), "impulse", data=x, data_fit=2)
    assert says(str(e.value), "data", "1 inf of its 6,144 values", "finite inputs")
    assert not any(cache_dir.rglob("*-fit-*.safetensors"))


def test_a_fit_that_produces_non_finite_values_fails_and_stores_nothing(cache_dir):
    """Case 2: finite inputs that overflow the model (3e38) make the fit non-finite: it fails with
    its own message, and no fitted artifact is cached."""
    from structinit.errors import StructinitError
    from structinit.init.initialize import initialize_model

    x = torch.full((8, 3, 16, 16), 3e38)
    with pytest.raises(StructinitError) as e:
        initialize_model(timm_vit(), "impulse", data=x, data_fit=2)
    assert says(str(e.value), "data fit", "non-finite values", "nothing was stored")
    assert not any(cache_dir.rglob("*-fit-*.safetensors"))


def test_a_non_finite_artifact_in_the_cache_is_named_as_such_and_never_written(cache_dir):
    """Case 2: an artifact holding NaN (with valid checksums) is reported as non-finite, not as
    edited, and set aside; ``write_artifact`` refuses to write one."""
    import numpy as np
    from safetensors.numpy import load, save

    from structinit.errors import ArtifactError
    from structinit.init.initialize import initialize_model
    from structinit.solver import artifact as art_module

    report = initialize_model(timm_vit(), "impulse", data_fit=0)
    path = art_module.Path(report["artifact"]["path"])
    raw = path.read_bytes()
    tensors = load(raw)
    tensors["q"] = tensors["q"].copy()
    tensors["q"][0, 0, 0, 0] = np.nan
    meta = art_module._metadata(raw)
    meta.pop("header_checksum")
    meta["checksum"] = art_module._checksum(tensors)
    meta["header_checksum"] = art_module._header_checksum(meta)
    path.write_bytes(save(tensors, metadata=meta))
    with pytest.raises(ArtifactError, match=r"its tensors hold values that are not finite \(q: 1 of "):
        art_module.read_artifact(path)
    with pytest.warns(UserWarning) as seen:
        again = initialize_model(timm_vit(), "impulse", data_fit=0)
    said = [str(w.message) for w in seen.list if "ignoring" in str(w.message)]
    assert len(said) == 1 and "not finite (q: 1 of" in said[0] and "edited" not in said[0], said
    assert again["artifact"]["cached"] is False and art_module.read_artifact(path).key == report["artifact"]["key"]
    broken = art_module.read_artifact(path)
    broken.q = broken.q.copy()
    broken.q[0, 0, 0, 0] = np.inf
    with pytest.raises(ArtifactError, match=r"not written: its tensors hold values that are not finite \(q: 1 of "):
        art_module.write_artifact(broken, cache_dir / "x.safetensors")
    assert not (cache_dir / "x.safetensors").exists()


def test_an_integer_checkpoint_is_refused_naming_the_tensor_and_dtype(cli, made, tmp_path, cache_dir):
    """Case 14: an int8 checkpoint is refused up front (not after a fit, as a misplaced write)."""
    sd = {k: v.to(torch.int8) if v.is_floating_point() else v for k, v in torch.load(made / "plain.pt").items()}
    torch.save(sd, tmp_path / "int8.pt")
    line = refused(cli("apply", tmp_path / "int8.pt", "--heads", HEADS, "--out", tmp_path / "o.pt"))
    assert says(line, str(tmp_path / "int8.pt"), "blocks.0.attn.qkv.weight", "int8", "not floating point",
                "float checkpoint")
    assert not (tmp_path / "o.pt").exists() and not any(cache_dir.rglob("*.safetensors"))


# --------------------------------------------------------------------------- artifacts, given and cached

def test_a_missing_artifact_is_refused_by_a_dry_run_as_by_the_real_run(cli, made, tmp_path):
    """Case 17: ``--artifact missing.safetensors --dry-run`` fails as the run would, before any plan."""
    want = ("--artifact missing.safetensors", "no such file", "no cached artifact", "structinit inspect")
    for dry in (["--dry-run"], []):
        r = cli("apply", made / "plain.pt", "--heads", HEADS, "--artifact", "missing.safetensors", *dry,
                "--out", tmp_path / "o.pt")
        assert says(refused(r), *want)
    assert not (tmp_path / "o.pt").exists()


def test_a_fitted_artifact_of_other_weights_is_refused_and_one_of_these_is_written_as_given(cli, made, tmp_path,
                                                                                             cache_dir):
    """Case 17: ``apply other.pt --artifact FIT`` with FIT fitted through plain.pt's weights is
    refused (it does not belong to them); on plain.pt it is written as given, no fit run, and the
    report says so."""
    first = cli("apply", made / "plain.pt", "--heads", HEADS, *QUICK, "--out", tmp_path / "a.pt", "--json")
    assert first.returncode == 0, first.stderr
    fit = json.loads(first.stdout)["data_fit"]["artifact"]["path"]
    torch.save(timm_vit(seed=5).state_dict(), tmp_path / "other.pt")
    line = refused(cli("apply", tmp_path / "other.pt", "--heads", HEADS, "--artifact", fit, "--out", tmp_path / "b.pt"))
    assert line.startswith(f"error: the --artifact {fit} was fitted through other weights (digest ") \
        and line.endswith("its Q/K do not belong to them; leave artifact out to fit them here"), line
    assert not (tmp_path / "b.pt").exists()
    fits = sorted(cache_dir.glob("*-fit-*"))
    again = cli("apply", made / "plain.pt", "--heads", HEADS, "--artifact", fit, "--out", tmp_path / "c.pt")
    assert again.returncode == 0, again.stderr
    assert sorted(cache_dir.glob("*-fit-*")) == fits and "no data given" not in again.stderr  # no fit ran
    assert ", the given --artifact)" in again.stdout
    assert torch.equal(load_sd(tmp_path / "c.pt")["blocks.1.attn.qkv.weight"],
                       load_sd(tmp_path / "a.pt")["blocks.1.attn.qkv.weight"])


def test_solve_json_keeps_the_warning_about_a_corrupt_artifact(cli, cache_dir):
    """Case 17: ``solve --json`` says on stderr that it set a corrupt cached artifact aside, once."""
    args = ("solve", "--tokens", "16", "--dim", "32", "--heads", "2")
    assert cli(*args).returncode == 0
    (path,) = cache_dir.glob("*.safetensors")
    path.write_bytes(b"garbage")
    for extra in (["--json"], []):
        r = cli(*args, *extra)
        assert r.returncode == 0, r.stderr
        warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ignoring corrupt artifact")]
        assert len(warned) == 1 and str(path) in warned[0], r.stderr
        path.write_bytes(b"garbage")


def test_a_learned_embedding_takes_the_subspace_table_with_the_plain_solve(cli, made, tmp_path):
    """Case 17: ``--data-fit 0 -p position_subspace=true`` on a learned position embedding is not
    refused with advice the subspace refuses (fit_pe) or overwrites (set_pe): the subspace writes
    its own table, as on a model."""
    r = cli("apply", made / "learned.pth", "--heads", HEADS, "--data-fit", "0", "-p", "position_subspace=true",
            "--out", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    before, after = torch.load(made / "learned.pth")["pos_embed"], load_sd(tmp_path / "o.pt")["pos_embed"]
    assert not torch.equal(before, after) and json.loads(r.stdout)["params"]["position_subspace"] is True


def rewritten(path, edit):
    """The artifact at ``path`` with ``edit(tensors)`` applied and both checksums made again (what
    structinit's own writer would make of the edited tensors): whole and consistent as a file."""
    from safetensors.numpy import load, save

    from structinit.solver import artifact as art_module

    raw = path.read_bytes()
    tensors = {k: v.copy() for k, v in load(raw).items()}
    edit(tensors)
    meta = art_module._metadata(raw)
    meta.pop("header_checksum", None)
    meta["checksum"] = art_module._checksum(tensors)
    meta["header_checksum"] = art_module._header_checksum(meta)
    return save(tensors, metadata=meta)


def scale_head(tensors):
    tensors["q"][0, 2] *= 1.01


def swap_heads(tensors):
    for name in ("q", "k"):
        tensors[name][0, [0, 1]] = tensors[name][0, [1, 0]]


@pytest.mark.parametrize("edit, head", [(scale_head, 2), (swap_heads, 0)])
def test_a_per_head_edit_of_an_artifact_is_caught(cache_dir, edit, head):
    """Case 7: one head's Q scaled by 1.01, or two heads' Q/K swapped, written with valid checksums:
    the content check compares every head's target mass with its stats, not only the layer mean."""
    from structinit.errors import ArtifactError
    from structinit.solver.artifact import read_artifact
    from structinit.solver.cache import resolve_artifact
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import solve

    config = SolveConfig(grid=(8, 8), dim=DIM, heads=HEADS, filter=3, layers=1, seed=0)
    path = solve(config, cache_dir=cache_dir, force=True).artifact.path  # solved into the user cache, not shipped
    assert path.parent == cache_dir
    path.write_bytes(rewritten(path, edit))
    read_artifact(path)  # whole and consistent as a file
    with pytest.raises(ArtifactError, match=rf"its Q/K give head {head} of layer 0 a target mass of .* the tensors are "
                                            "not the ones that were solved"):
        resolve_artifact(path)


# --------------------------------------------------------------------------- what the position subspace cannot keep

def test_the_subspace_is_refused_where_it_would_change_what_the_user_keeps(cli, made, tmp_path):
    """Case 5: ``--no-mimetic-vproj`` promises the checkpoint's V/proj, and ``--layers 1`` layer 0
    and the embeddings it reads; the position subspace rewrites both, so it is refused with them."""
    args = ("apply", made / "plain.pt", "--heads", HEADS, "-p", "position_subspace=true", "--out", tmp_path / "o.pt")
    assert says(refused(cli(*args, "--no-mimetic-vproj")), "position_subspace", "output projection",
                "--no-mimetic-vproj", "give one of them")
    assert says(refused(cli(*args, "--layers", "1")), "position_subspace", "--layers", "would change too",
                "select every layer")
    assert not (tmp_path / "o.pt").exists()


def test_no_mimetic_vproj_and_a_layer_selection_keep_what_they_promise(cli, made, tmp_path):
    """Case 5, what is kept: with ``--no-mimetic-vproj --layers 1`` every tensor but layer 1's Q/K
    is the checkpoint's, bit for bit (patch and position embedding included)."""
    r = cli("apply", made / "plain.pt", "--heads", HEADS, *QUICK, "--no-mimetic-vproj", "--layers", "1",
            "--out", tmp_path / "o.pt")
    assert r.returncode == 0, r.stderr
    before, after = torch.load(made / "plain.pt"), load_sd(tmp_path / "o.pt")
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["blocks.1.attn.qkv.weight"]  # its bias was zero, and stays so
    assert torch.equal(before["blocks.1.attn.qkv.weight"][2 * DIM:], after["blocks.1.attn.qkv.weight"][2 * DIM:])


def test_a_hugging_face_folder_with_two_weights_files_is_refused(cli, tmp_path):
    """Case 6: a folder holding model.safetensors and pytorch_model.bin would have one initialized
    and the other copied beside it, stale: refused, saying why; nothing is written."""
    folder = hf_vit_folder(tmp_path / "vit", json.dumps({"num_attention_heads": 2, "hidden_size": 8}).encode())
    import safetensors.torch

    torch.save(safetensors.torch.load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    line = refused(cli("apply", folder, "--method", "mimetic", "--out", tmp_path / "out"))
    assert says(line, str(folder), "both model.safetensors and pytorch_model.bin", "remove the one",
                "give its file")
    assert not (tmp_path / "out").exists()
    (folder / "pytorch_model.bin").unlink()
    assert cli("apply", folder, "--method", "mimetic", "--out", tmp_path / "out").returncode == 0


def test_a_grid_file_that_is_a_device_or_a_fifo_is_named_for_what_it_is(cli, tmp_path):
    """Case 17: ``bench grid /dev/zero`` and a FIFO named ``.toml`` are not said not to exist, and
    neither is read (the FIFO answers any reader, so a read fails the assertion instead of hanging)."""
    from conftest import feeding_fifo

    line = refused(cli("bench", "grid", "/dev/zero"))
    assert says(line, "grid file /dev/zero", "character device", "not a regular file")
    fifo = tmp_path / "g.toml"
    with feeding_fifo(fifo, b'name = "x"\n'):
        line = refused(cli("bench", "grid", fifo))
    assert says(line, f"grid file {fifo}", "FIFO", "not a regular file")
    line = refused(cli("bench", "grid", tmp_path / "none.toml"))
    assert says(line, f"grid file {tmp_path / 'none.toml'}", "does not exist")


def test_an_attention_masks_minus_inf_is_no_divergence_but_a_nan_in_it_is():
    from structinit.errors import UsageError
    from structinit.init.finite import check_finite

    mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
    check_finite([("blocks.0.attn.mask", mask), ("w", torch.ones(2))], "the model")
    for bad in (float("nan"), float("inf")):
        broken = mask.clone()
        broken[0, 0] = bad
        with pytest.raises(UsageError, match="tensor blocks.0.attn.mask holds"):
            check_finite([("blocks.0.attn.mask", broken)], "the model")
    with pytest.raises(UsageError, match=r"^the model: tensor w holds 1 inf of its 2 values"):
        check_finite([("w", torch.tensor([1.0, float("-inf")]))], "the model")


def test_a_corrupt_copy_that_is_not_set_aside_is_told_once(cli, tmp_path, cache_dir, monkeypatch):
    """Case 17: a corrupt shipped copy (read only, never set aside) is read before the key's lock and
    again under it; ``solve`` says so once, not twice."""
    from structinit.solver import cache as cache_mod
    from structinit.solver.config import SolveConfig

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    config = SolveConfig(grid=(4, 4), dim=32, heads=2, filter=3, layers=1, seed=0)
    (shipped / config.filename).write_bytes(b"garbage")
    monkeypatch.setattr(cache_mod, "shipped_cache_dir", lambda: shipped)
    r = cli("solve", "--tokens", "16", "--dim", "32", "--heads", "2")
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ignoring corrupt artifact")]
    assert len(warned) == 1 and str(shipped / config.filename) in warned[0], r.stderr


# --------------------------------------------------------------------------- tensor files, branch by branch

def npy_file(path, arr, version=None, cut=None):
    """``arr`` as a .npy file at ``path`` (format ``version``), its last ``cut`` bytes dropped."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version)
    raw = buf.getvalue()
    path.write_bytes(raw[:len(raw) - cut] if cut else raw)
    return path


def safetensors_file(path, header, body=b""):
    """A safetensors file at ``path`` with ``header`` (a dict, or raw bytes) and ``body``."""
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return path


def test_npy_files_are_read_whole_and_refused_damaged_with_the_reason(tmp_path):
    import numpy as np

    from structinit.apply.tensor_files import read_npy
    from structinit.errors import UsageError

    arr = np.arange(60, dtype=np.float32).reshape(20, 3)
    for version in ((1, 0), (2, 0)):
        assert torch.equal(read_npy(npy_file(tmp_path / "a.npy", arr, version)), torch.from_numpy(arr))
    fortran = np.asfortranarray(arr)
    assert torch.equal(read_npy(npy_file(tmp_path / "f.npy", fortran)), torch.from_numpy(arr))

    def why(path):
        with pytest.raises(UsageError) as err:
            read_npy(path)
        return err.value.render()

    cut = npy_file(tmp_path / "cut.npy", arr, cut=100)
    assert why(cut) == (f"data {cut} is damaged: its header promises [20, 3] float32 values (240 bytes), but the file "
                        "holds 140 after it")
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x03\x00" + bytes(8))
    assert why(bad) == (f"data {bad} is damaged: its header cannot be read (format version 3.0, which NumPy 1.x files "
                        "do not use)")
    bad.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': 1,    }\n")
    assert why(bad).startswith(f"data {bad} is damaged: its header cannot be read (")
    words = npy_file(tmp_path / "u.npy", np.array([["ab", "c"]]))
    assert why(words) == (f"data {words} holds <U2 values, not numbers; give float inputs normalized as the model "
                          "sees them")


def test_safetensors_files_are_checked_against_their_size_branch_by_branch(tmp_path):
    import numpy as np

    from structinit.apply.tensor_files import read_safetensors_inputs
    from structinit.errors import UsageError

    def why(path):
        with pytest.raises(UsageError) as err:
            read_safetensors_inputs(path)
        return err.value.render()

    two = np.arange(2, dtype=np.float32).tobytes()
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    p = tmp_path / "x.safetensors"
    assert torch.equal(read_safetensors_inputs(safetensors_file(p, {"__metadata__": {"a": "b"}, "other": entry}, two)),
                       torch.tensor([0.0, 1.0]))
    both = {"a": entry, "inputs": {**entry, "data_offsets": [8, 16]}}
    assert torch.equal(read_safetensors_inputs(safetensors_file(p, both, two + two[::-1])),
                       torch.from_numpy(np.frombuffer(two[::-1], dtype=np.float32).copy()))
    assert says(why(safetensors_file(p, {"a": entry, "b": {**entry, "data_offsets": [8, 16]}}, two + two)),
                f"data {p}", "2 tensors", "'inputs'")
    damaged = f"data {p} is damaged"
    p.write_bytes(b"\x05\x00")
    assert says(why(p), damaged, "header's length")
    p.write_bytes((4096).to_bytes(8, "little") + b"{}")
    assert says(why(p), damaged, "4,096 bytes", "holds 2")
    assert says(why(safetensors_file(p, b"{not json}")), damaged, "not JSON")
    assert says(why(safetensors_file(p, b"[1, 2]")), damaged, "not a JSON object")
    for broken in ({"dtype": "F32", "shape": [2]}, {**entry, "dtype": "X9"}, {**entry, "shape": "two"}):
        assert says(why(safetensors_file(p, {"inputs": broken}, two)), damaged, "entry for 'inputs'", "not a tensor")
    gap = safetensors_file(p, {"inputs": {**entry, "data_offsets": [4, 12]}}, two + two)  # inside, not from 0
    assert says(why(gap), damaged, "invalid offset", "`inputs`")
    for offsets, body in (([0, 4], two), ([0, 8], two[:4]), ([8, 0], two)):
        assert says(why(safetensors_file(p, {"inputs": {**entry, "data_offsets": offsets}}, body)), damaged,
                    "'inputs'", "shape [2]", f"{offsets[0]}..{offsets[1]}", f"holds {len(body)} bytes")


def test_each_tensor_is_checked_past_a_mask_or_a_missing_one():
    """A mask's -inf, or a tensor the layout names but the file lacks (``None``), ends no check: the
    tensors after it are checked too."""
    from structinit.errors import UsageError
    from structinit.init.finite import check_finite, check_float_weights

    mask = torch.triu(torch.full((3, 3), float("-inf")), diagonal=1)
    with pytest.raises(UsageError, match=r"^the model: tensor w holds 1 NaN of its 2 values"):
        check_finite([("attn.mask", mask), ("w", torch.tensor([0.0, float("nan")]))], "the model")
    with pytest.raises(UsageError, match=r"^the file: tensor q is int8, not floating point"):
        check_float_weights([("bias", None), ("q", torch.zeros(2, dtype=torch.int8))], "the file")
