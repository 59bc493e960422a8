"""An init method from another installed package (issue 53): a distribution on the path whose
entry point in the group ``structinit.inits`` names a module that registers a method works through
``structinit apply --method NAME`` with no edit to structinit, is listed in ``--help``, and a
plugin that fails to load is named in one warning line without breaking the built-in methods."""

import re
import textwrap

import pytest
import torch
from conftest import REPO, error_line
from test_injection import tiny_vit

from structinit.init.registry import ENTRY_POINT_GROUP

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass

    from structinit.init.base import register
    from structinit.init.mimetic import MimeticInit


    @register
    @dataclass(frozen=True)
    class HalfMimetic(MimeticInit):
        """Mimetic at half its Q/K scales: a method of another package."""

        method = "half-mimetic"
        alpha1: float = 0.35
        beta1: float = 0.35
''')


def help_text(text):
    """``--help`` output as one line: its wrapping undone, a name the wrap broke at a hyphen joined."""
    return re.sub(r"(\w-) (?=\w)", r"\1", " ".join(text.split()))


def _install(site, name, module, code):
    """A distribution ``name`` in folder ``site`` (as pip lays one out) with ``module`` as its plugin."""
    (site / f"{module}.py").write_text(code)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}\n")


@pytest.mark.slow  # a fresh interpreter: the registry loads the entry points once, at import
def test_a_method_of_another_installed_package_works_through_apply(tmp_path, cli_process):
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "half-mimetic-init", "half_mimetic_init", PLUGIN)
    env = {"PYTHONPATH": f"{site}:{REPO}"}
    torch.save(tiny_vit(depth=2).state_dict(), tmp_path / "v.pt")
    r = cli_process("apply", tmp_path / "v.pt", "--method", "half-mimetic", "--heads", "4", "--out",
                    tmp_path / "o.pt", "--json", env=env)
    assert r.returncode == 0, r.stderr
    import json

    assert json.loads(r.stdout)["method"] == "half-mimetic"
    assert "half-mimetic" in help_text(cli_process("apply", "--help", env=env).stdout)
    # a plugin that fails to load is one warning line; the built-in methods still work
    _install(site, "broken-init", "broken_init", "raise ImportError('no such thing')\n")
    r = cli_process("apply", tmp_path / "v.pt", "--method", "mimetic", "--heads", "4", "--out", tmp_path / "m.pt",
                    env=env)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "broken-init" in line]
    assert len(said) == 1 and said[0].startswith("warning: init plugin broken-init (broken_init) was not loaded")


@pytest.mark.slow  # fresh interpreters: the registry loads the entry points once, at import
def test_a_method_of_another_installed_package_is_listed_in_every_help_and_refuses_foreign_aliases(tmp_path,
                                                                                                    cli_process):
    """Issue 53: every help text that lists methods reads them from the registry, so a method added
    through the entry point is in apply's, train's and inspect's ``--help`` (and, having ``base``,
    among the methods train's help says start from it); an apply alias of a parameter it lacks is
    refused naming the flag and the method."""
    import re

    site = tmp_path / "site"
    site.mkdir()
    _install(site, "half-mimetic-init", "half_mimetic_init", PLUGIN)
    env = {"PYTHONPATH": f"{site}:{REPO}"}
    for command in ("apply", "train", "inspect"):
        text = help_text(cli_process(command, "--help", env=env).stdout)
        assert re.search(r"(?<![\w-])half-mimetic(?![\w-])", text), command
    train = help_text(cli_process("train", "--help", env=env).stdout)
    assert re.search(r"mimetic, impulse, conditioned and half-mimetic start the weights", train), train
    torch.save(tiny_vit(depth=2).state_dict(), tmp_path / "v.pt")
    r = cli_process("apply", tmp_path / "v.pt", "--method", "half-mimetic", "--heads", "4", "--filter", "3", env=env)
    line = error_line(r.stderr)
    assert r.returncode == 2 and "--filter" in line and "half-mimetic init does not have" in line
    assert "alpha1" in line and sorted(p.name for p in tmp_path.iterdir()) == ["site", "v.pt"]
