"""A data-fit parameter set while ``data_fit`` is 0 would change nothing: it is refused, naming it;
``without_fit`` (what a resumed run re-applies) is a valid spec that fits nothing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from structinit.errors import UsageError
from structinit.init.impulse_checks import FIT_ONLY_PARAMS
from structinit.init.registry import init_spec

#: A value away from the default for each fit-only parameter (valid with a fit).
AWAY = {"data_fit_mass": 0.8, "data_fit_l2": 0.5, "data_fit_lr": 0.05, "data_fit_norm": 3.0,
        "data_fit_samples": 64, "data_fit_batch": 4, "data_fit_inputs": "noise"}


def test_every_fit_only_parameter_has_a_value_here():
    assert set(AWAY) == set(FIT_ONLY_PARAMS)


@pytest.mark.parametrize("name", FIT_ONLY_PARAMS)
def test_fit_only_parameter_refused_without_a_fit(name):
    init_spec("impulse", **{name: AWAY[name]})  # accepted with the fit on
    with pytest.raises(UsageError) as e:
        init_spec("impulse", data_fit=0, **{name: AWAY[name]})
    text = str(e.value)
    assert f"parameter {name} " in text and "data_fit is 0" in text


@pytest.mark.parametrize("name", [n for n in FIT_ONLY_PARAMS if n != "data_fit_batch"])
def test_without_fit_is_a_spec_that_fits_nothing(name):
    spec = init_spec("impulse", **{name: AWAY[name]})
    rest = spec.without_fit()
    assert rest.data_fit == 0 and not rest.uses_data
    defaults = {f.name: f.default for f in dataclasses.fields(rest)}
    assert all(getattr(rest, n) == defaults[n] for n in FIT_ONLY_PARAMS)
    assert init_spec("impulse", **rest.params()) == rest  # rebuilds: nothing it holds is refused


def test_the_fit_version_is_accepted_without_a_fit_as_old_keys_had_it():
    assert init_spec("impulse", data_fit=0, data_fit_version=1).to_dict() == init_spec("impulse", data_fit=0).to_dict()


def test_apply_names_the_flag_of_the_parameter(tmp_path):
    r = subprocess.run([sys.executable, "-m", "structinit", "apply", str(tmp_path / "none.pt"), "--data-fit", "0",
                        "-p", "data_fit_mass=0.8", "-o", str(tmp_path / "out.pt")],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "data_fit_mass" in r.stderr and "data_fit is 0" in r.stderr and "Traceback" not in r.stderr
