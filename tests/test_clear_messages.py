"""Messages that name the real cause (issue 45): advice never repeats what the user already set,
a refusal names every way out the command has, and `inspect` says what a fit on noise ran on."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import digits_images, error_line, vit_digits

from structinit.errors import StructinitWarning
from structinit.init.initialize import initialize_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weak_warning(**params) -> str:
    """The weak-structure warning of a one-step fit on 16 digits (one step leaves the layers weak)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        initialize_model(vit_digits(), "impulse", data=digits_images(16), data_fit=1, data_fit_samples=16, seed=0,
                         **params)
    weak = [str(w.message) for w in seen if isinstance(w.message, StructinitWarning)
            and "the data fit left layer" in str(w.message)]
    assert len(weak) == 1, [str(w.message) for w in seen]
    return weak[0]


def test_the_weak_structure_warning_advises_only_what_was_not_set_already():
    """Issue 45: it advised data_fit_mass=0.8 to a user who had passed it."""
    default = _weak_warning()
    assert "content fills the stream), more steps (data_fit=1000), a sharper fit target (data_fit_mass=0.8), more " \
           "inputs or a stronger position signal (pe_scale=2" in default
    sharp = _weak_warning(data_fit_mass=0.8)
    assert "data_fit_mass" not in sharp
    assert "content fills the stream), more steps (data_fit=1000), more inputs or a stronger position signal " \
           "(pe_scale=2" in sharp
    sharper = _weak_warning(data_fit_mass=0.9)
    assert "data_fit_mass" not in sharper and "more steps (data_fit=1000), more inputs or" in sharper



def test_a_bare_timm_checkpoint_asks_for_its_heads_or_its_model(tmp_path, cli):
    """Issue 45: a bare `apply ckpt.pt` on a timm state dict asked for --heads only, though naming the
    model (--model, the README's own example) tells them too; where the fit is off, --model would be
    refused, so it is not offered."""
    torch.save(vit_digits().state_dict(), tmp_path / "vit.pt")
    r = cli("apply", tmp_path / "vit.pt")
    assert r.returncode == 2 and error_line(r.stderr) == (
        "error: the timm-vit checkpoint does not tell its number of heads; give it with --heads (it must divide dim "
        "64), or name the timm model it holds with --model (e.g. vit_tiny_patch16_224)")
    r = cli("apply", tmp_path / "vit.pt", "--data-fit", "0")
    assert r.returncode == 2 and error_line(r.stderr) == (
        "error: the timm-vit checkpoint does not tell its number of heads; give it with --heads (it must divide dim "
        "64)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit.pt"]


def test_inspect_says_what_a_fit_on_noise_ran_on(cli, cache_dir):
    """Issue 45: a noise-fitted artifact showed "(None inputs, ?...)"."""
    rep = initialize_model(vit_digits(), "impulse", data_fit=2, data_fit_samples=16, seed=3)
    path = Path(rep["data_fit"]["artifact"]["path"])
    r = cli("inspect", path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "fitted to 16 Gaussian noise inputs N(0, 1) of shape [1, 8, 8], drawn with seed 3 (no data)" in lines
    assert "None" not in r.stdout and "?..." not in r.stdout
    shown = json.loads(cli("inspect", path, "--json").stdout)["fit"]["identity"]["inputs"]
    assert shown == {"kind": "noise", "seed": 3, "samples": 16, "shape": [1, 8, 8]}
