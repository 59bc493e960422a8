"""Hostile input to ``apply``, ``solve`` and the init, round 6 (issue 54): non-finite and integer
weights, damaged data files, options that conflict or would do nothing, silent caps, and refusals
that named the wrong cause. Each case is one ``error:`` line (``conftest.error_line``) with the
documented exit code, or the behaviour the user asked for; nothing is written from a refused input."""

import json
import typing

import pytest
import torch
from conftest import error_line

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

def timm_vit(class_token=False, learned=False, depth=2, seed=0):
    """A timm ViT of an 8x8 grid (16x16 images, 2x2 patches), dim 64, 4 heads; the sin-cos table
    unless ``learned``."""
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(seed)
    m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=DIM, depth=depth,
                          num_heads=HEADS, class_token=class_token, global_pool="token" if class_token else "avg",
                          num_classes=10)
    if not learned:
        set_sincos_pos_embed(m, zero_prefix=True)
    return m


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
    (["-p", "filter=5", "--filter", "3"], "--filter 3 and --init-param filter=5 both set filter; give one of them"),
    (["-p", "data_fit=100", "--data-fit", "200"],
     "--data-fit 200 and --init-param data_fit=100 both set data_fit; give one of them"),
    (["-p", "share=false", "--share"], "--share and --init-param share=false both set share; give one of them"),
    (["-p", "mimetic_vproj=true", "--no-mimetic-vproj"],
     "--no-mimetic-vproj and --init-param mimetic_vproj=true both set mimetic_vproj; give one of them"),
    (["-p", "target_mass=0.3", "-p", "target_mass=0.5"],
     "--init-param sets target_mass twice (target_mass=0.3, target_mass=0.5); give it once"),
    (["--recipe-param", "iters=20", "--recipe-param", "iters=30"],
     "--recipe-param sets iters twice (iters=20, iters=30); give it once"),
    (["-p", "data_fit_samples=16", "--data", "noise", "--samples", "40"],
     "--samples and --init-param data_fit_samples both set how many inputs the fit reads; give one of them"),
])
def test_conflicting_values_are_refused_naming_both(cli, made, tmp_path, args, want):
    """Case 4: a value given twice (a flag and ``-p``, or ``-p`` twice) is refused, naming both; no
    output is written."""
    r = cli("apply", made / "plain.pt", "--heads", HEADS, *args, "--out", tmp_path / "o.pt")
    assert refused(r) == "error: " + want
    assert not (tmp_path / "o.pt").exists()


def test_a_setting_given_twice_is_refused_by_train_too(cli, tmp_path):
    r = cli("train", "--dataset", "digits", "-p", "filter=3", "-p", "filter=5", "--out", tmp_path / "run")
    assert refused(r) == "error: --init-param sets filter twice (filter=3, filter=5); give it once"
    assert not (tmp_path / "run").exists()
