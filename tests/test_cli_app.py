"""The command line as a whole: one error convention, flags that mean one thing, help that shows
defaults and copyable examples, and an import path free of torch."""

import json
import re
import subprocess
import sys

import pytest
import typer.main
from conftest import error_line, says

from structinit.cli.app import app, main
from structinit.cli.common import SHORT_FLAGS
from structinit.errors import UsageError, param


def _commands(group=None, path=()):
    group = group or typer.main.get_command(app)
    for name, cmd in getattr(group, "commands", {}).items():
        if getattr(cmd, "commands", None):
            yield from _commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def test_every_short_flag_means_one_long_flag_everywhere():
    seen = {}
    for path, cmd in _commands():
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            shorts = [o for o in p.opts if not o.startswith("--")]
            longs = [o for o in p.opts if o.startswith("--")]
            for s in shorts:
                seen.setdefault(s, set()).add(longs[0])
                assert s in SHORT_FLAGS and SHORT_FLAGS[s] == longs[0], (path, s, longs)
    assert all(len(v) == 1 for v in seen.values()), seen


def test_every_command_has_help_with_examples_and_visible_defaults(cli):
    for path, _ in _commands():
        r = cli(*path, "--help")
        assert r.returncode == 0, (path, r.stderr)
        assert "Examples:" in r.stdout and "structinit " in r.stdout.split("Examples:")[1], path
        assert "<bool>" not in r.stdout, path
        assert not [line for line in r.stdout.splitlines() if re.search(r"\s\.\s*$", line)], path  # a lost default
    solve_help = cli("solve", "--help").stdout
    assert "[default: (0.3)]" in solve_help and "[default: 192]" in solve_help


def test_examples_are_never_wrapped_mid_command(cli):
    for path, _ in _commands():
        text = cli(*path, "--help").stdout.split("Examples:")[1]
        for line in text.strip().splitlines():
            assert line.strip().startswith(("structinit ", "torchrun ")), (path, line)


def test_parser_errors_are_one_line_with_exit_2(cli):
    r = cli("solve", "--dimm", "3")
    assert r.returncode == 2 and r.stdout == ""
    assert error_line(r.stderr).startswith("error: No such option: --dimm")
    r = cli("nonsense")
    assert r.returncode == 2 and error_line(r.stderr)


def test_library_errors_name_parameters_and_the_cli_names_flags(cli):
    from structinit import SolveConfig

    with pytest.raises(UsageError) as exc:
        SolveConfig(grid=(16, 16), dim=192, heads=5)
    assert says(str(exc.value), "dim 192", "not divisible", "heads 5")
    assert says(exc.value.render(lambda n: f"<{n}>"), "<dim> 192", "not divisible", "<heads> 5")
    r = cli("solve", "--dim", "192", "--heads", "5")
    assert r.returncode == 2 and says(error_line(r.stderr), "error: ", "--dim 192", "not divisible", "--heads 5")
    # a parameter the command spells differently (solve's --depth is SolveConfig's layers)
    r = cli("solve", "--depth", "0")
    assert r.returncode == 2 and "--depth must be a positive integer" in r.stderr
    assert str(UsageError(f"{param('x')} bad")) == "x bad"


def test_version_and_json_are_for_scripts(cli):
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("structinit ")
    r = cli("inspect", "--json")
    assert r.returncode == 0 and "artifacts" in json.loads(r.stdout)


@pytest.mark.slow
def test_import_and_help_do_not_import_torch():
    code = ("import sys, structinit; from structinit import solve, SolveConfig, initialize_model, apply_checkpoint, "
            "train, TrainConfig; from structinit.cli.app import main; main(['--help']); main(['solve', '--help']); "
            "print('TORCH' if 'torch' in sys.modules or 'timm' in sys.modules else 'LIGHT')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("LIGHT")


def test_lazy_exports_resolve_to_the_library():
    import structinit
    from structinit.solver.run import solve

    assert structinit.solve is solve
    with pytest.raises(AttributeError):
        structinit.no_such_name  # noqa: B018


def test_main_returns_the_exit_code_of_a_library_failure(tmp_path, capsys):
    code = main(["inspect", str(tmp_path / "missing.pt")])
    assert code == 2 and capsys.readouterr().err.startswith("error: ")


def test_the_librarys_warning_is_one_warning_line_wherever_its_stack_level_points(capsys):
    """A StructinitWarning whose reported frame is outside the package (a wrapper such as mutmut's
    trampoline, or a user's function in between) is still one ``warning:`` line; another library's
    warning keeps Python's form."""
    from structinit.cli.app import _show_warning
    from structinit.errors import StructinitWarning

    _show_warning(StructinitWarning("the fit is weak"), StructinitWarning, "/elsewhere/wrapper.py", 100)
    _show_warning(UserWarning("theirs"), UserWarning, "/elsewhere/lib.py", 7)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "warning: the fit is weak"
    assert err[1] == "/elsewhere/lib.py:7: UserWarning: theirs"


def test_train_and_apply_options_default_to_the_librarys_own():
    """Issue 53: train's and apply's defaults are read from the library (``TrainConfig``,
    ``ApplyOptions``), never typed twice: every option that has a library setting of the same
    name starts at that setting's default, and every default a command shows for one that the
    library resolves later (``None``) is ``None`` there too."""
    from structinit.apply.options import ApplyOptions
    from structinit.training.config import TrainConfig

    commands = dict(_commands())
    library = {("train",): TrainConfig().to_dict(), ("apply",): vars(ApplyOptions())}
    named = {"compile_": "compile"}
    for path, defaults in library.items():
        compared = 0
        for p in commands[path].params:
            name = named.get(p.name, p.name)
            if p.param_type_name != "option" or name not in defaults or name == "layers":
                continue  # apply's --layers all is ApplyOptions' None (every layer), checked in test_apply
            assert p.default == defaults[name], (path, name, p.default, defaults[name])
            compared += 1
        assert compared >= (30 if path == ("train",) else 10), compared


def test_shared_options_are_written_once_and_mean_the_same_in_every_command():
    """Issue 53: --seed and --data-dir were written per command (4 and 5 times, three different
    defaults shown for --data-dir). Each is declared once in cli.common (``seed_option``,
    ``data_dir_option``): every command that has it says the same thing and shows the library's
    default folder."""
    from pathlib import Path

    import structinit.cli
    from structinit.cli.common import DATA_DIR_DEFAULT

    cli_dir = Path(structinit.cli.__file__).parent
    for flag in ("--seed", "--data-dir"):
        written = [p.name for p in sorted(cli_dir.glob("*.py")) if f'option("{flag}"' in p.read_text()]
        assert written == ["common.py"], (flag, written)
    counts = {"--seed": 0, "--data-dir": 0}
    for path, cmd in _commands():
        for p in cmd.params:
            if "--data-dir" in p.opts:
                counts["--data-dir"] += 1
                assert "the folder a dataset's files are read from" in p.help.lower(), (path, p.help)
                assert str(p.show_default).endswith(DATA_DIR_DEFAULT) and p.metavar == "DIR", path
            if "--seed" in p.opts:
                counts["--seed"] += 1
                assert p.min == 0 and re.search(r"\b[Ss]eed of \w", p.help), (path, p.help)
    assert counts["--seed"] >= 7 and counts["--data-dir"] >= 5, counts
