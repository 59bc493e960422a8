"""Messages that name the real cause (issue 45): advice never repeats what the user already set,
a refusal names every way out the command has, and `inspect` says what a fit on noise ran on."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import error_line, filling_images, says, vit_digits, vit_filling

from structinit.errors import StructinitWarning
from structinit.init.initialize import initialize_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weak_warnings(**params) -> list:
    """The weak-structure warnings of a one-step fit of a model whose tokens fill its stream (one step
    leaves the layers weak)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        initialize_model(vit_filling(), "impulse", data_fit=1, data_fit_samples=16, seed=0, **params)
    return [str(w.message) for w in seen if isinstance(w.message, StructinitWarning)
            and "the data fit left layer" in str(w.message)]


def test_the_weak_structure_warning_advises_only_what_was_not_set_already():
    """Issue 45: it advised data_fit_mass=0.8 to a user who had passed it. Issue 52: what the fit used
    (the subspace, real inputs) is not advised again, and with nothing left to try nothing is said."""
    (noise,) = _weak_warnings()
    assert "try position_subspace=True (" in noise and "; then real inputs (data) (" in noise
    (data,) = _weak_warnings(data=filling_images(16))
    assert "try position_subspace=True (" in data and "real inputs" not in data
    (sub,) = _weak_warnings(position_subspace=True, position_dims=4)
    assert "position_subspace=True" not in sub and "try real inputs (data) (" in sub
    assert _weak_warnings(data=filling_images(16), position_subspace=True, position_dims=4) == []


def test_a_bare_timm_checkpoint_asks_for_its_heads_or_its_model(tmp_path, cli):
    """Issue 45: a bare `apply ckpt.pt` on a timm state dict asked for --heads only, though naming the
    model (--model, the README's own example) tells them too; where the fit is off, --model would be
    refused, so it is not offered."""
    torch.save(vit_digits().state_dict(), tmp_path / "vit.pt")
    r = cli("apply", tmp_path / "vit.pt")
    line = error_line(r.stderr)
    assert r.returncode == 2 and says(line, "timm-vit", "number of heads", "--heads", "dim 64", "--model")
    r = cli("apply", tmp_path / "vit.pt", "--data-fit", "0")
    line = error_line(r.stderr)
    assert r.returncode == 2 and says(line, "timm-vit", "number of heads", "--heads", "dim 64")
    assert "--model" not in line  # refused where the fit is off: not offered
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
