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
