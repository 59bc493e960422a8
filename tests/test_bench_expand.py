"""Expanding a grid into runs: settings merged in order, overrides, run keys shared across grids, the
manifest, and the printed `structinit train` commands that reproduce each run's key."""

import json
import shlex

import pytest
from conftest import says

from structinit.errors import StructinitError
from structinit.experiments.expand import Expansion, expand, parse_overrides
from structinit.experiments.gridspec import GridError, load_grid, parse_grid_text
from structinit.experiments.launch import init_solves, prepare_runs, print_commands
from structinit.experiments.task import read_run_config, train_command
from structinit.training.config import TrainConfig

GRID = """\
name = "mini"
seeds = 2
rows = "init"
baseline = "tn"
[settings]
model = "vit-digits"
dataset = "digits"
epochs = 7
[[axes.init]]
id = "tn"
init = "trunc-normal"
[[axes.init]]
id = "imp"
init = "impulse"
init_params = { filter = 5, target_mass = 0.4 }
[[axes.size]]
id = "small"
train_size = 100
epochs = 30
[[axes.size]]
id = "all"
"""


def mini(text=GRID):
    return parse_grid_text(text, "mini.toml", "mini")


def test_cells_merge_settings_then_axis_values_then_overrides(tmp_path):
    ex = expand(mini(), runs_dir=tmp_path)
    assert len(ex.cells) == 2 * 2 * 2 and len(ex.unique_cells()) == 8
    by = {(c.row, c.column, c.seed): c.config for c in ex.cells}
    imp_small = by[("imp", ("small",), 1)]
    assert imp_small.epochs == 30 and imp_small.train_size == 100 and imp_small.seed == 1
    assert imp_small.init_params == {"filter": 5, "target_mass": 0.4, "base": "pytorch-mlp"}  # train's base
    # init_params from several axes merge key by key (Table 6: pseudo input x shared solve x filter)
    t6 = expand(load_grid("table6"), seeds=1, runs_dir=tmp_path)
    cfg = next(c.config for c in t6.cells if c.row == "u-pe" and c.column == ("same", "h8", "imp5"))
    assert cfg.init_params == {"base": "model", "pseudo_input": "uniform", "pseudo_input_rest": "pe", "share": True,
                               "filter": 5}
    assert cfg.model.name == "vit-t-h8" and cfg.init.method == "impulse" and cfg.dataset == "cifar10"
    assert by[("imp", ("all",), 0)].epochs == 7 and by[("imp", ("all",), 0)].train_size is None
    assert imp_small.out == str(tmp_path / imp_small.key) and imp_small.resume
    # overrides win over the file, for every run; init_params.NAME only where the method takes it
    ex2 = expand(mini(), overrides=["epochs=2", "init_params.target_mass=0.6"], seeds="0,3", runs_dir=tmp_path)
    cfgs = {(c.row, c.column, c.seed): c.config for c in ex2.cells}
    assert set(s for _, _, s in cfgs) == {0, 3}
    assert all(c.epochs == 2 for c in cfgs.values())
    assert cfgs[("imp", ("small",), 3)].init_params["target_mass"] == 0.6
    assert "target_mass" not in cfgs[("tn", ("small",), 3)].init_params
    assert ex2.warnings == ["4 cell(s) warm up for 2 epochs but train for only 2: the learning rate never reaches "
                            "its peak (set warmup_epochs too)"]  # digits' default warm-up is 2 epochs
    short = expand(load_grid("digits"), overrides=["epochs=2"], seeds=1, only=["train_size=100,all"])
    assert short.warnings == [
        "9 cell(s) warm up for 2.65 epochs but train for only 2: the learning rate never reaches its peak (set "
        "warmup_epochs too)",
        "9 cell(s) warm up for 22.5 epochs but train for only 2: the learning rate never reaches its peak (set "
        "warmup_epochs too)"]
    with pytest.raises(GridError, match=r"overrides init_params.alpha9: no init method of this grid takes it"):
        expand(mini(), overrides=["init_params.alpha9=1"])


def test_a_cell_that_cannot_run_is_named():
    with pytest.raises(GridError) as e:
        expand(mini(GRID.replace('train_size = 100', 'train_size = 100\ninit_params = { filter = 3 }')))
    assert says(str(e.value), "mini.toml", "cell init=tn, size=small", "'trunc-normal'", "no parameter filter")
    with pytest.raises(GridError, match=r"cell init=tn, size=small: .*dim 30 is not divisible by .*heads 4"):
        expand(mini(), overrides=["dim=30"])


def test_overrides_are_typed_and_checked():
    assert parse_overrides(["epochs=3", "lr=1e-3", "device=cuda", "init_params.filter=5"]) == {
        "epochs": 3, "lr": 1e-3, "device": "cuda", "init_params.filter": 5}
    for bad, msg in ((["epoch=3"], r"overrides epoch=3: unknown setting 'epoch' \(did you mean 'epochs'\?\)"),
                     (["epochs=many"], r"overrides epochs=many: 'epochs' must be an integer, got 'many'"),
                     (["epochs"], "must look like NAME=VALUE"),
                     (["seed=3"], "'seed' is set by the launcher"),
                     (["out=x"], "'out' is set by the launcher")):
        with pytest.raises(StructinitError, match=msg):
            parse_overrides(bad)
    with pytest.raises(GridError, match=r"cell init=tn, size=small: .*epochs must be a positive integer, got 0"):
        expand(mini(), overrides=["epochs=0"])


def test_the_same_run_in_two_grids_is_one_run(tmp_path):
    """Table 2's impulse-3 on CIFAR-10 and Table 6's PE/PE, one solve per layer, ViT-T/h3, Imp.-3 are one run."""
    t2 = expand(load_grid("table2"), seeds=1, runs_dir=tmp_path)
    t6 = expand(load_grid("table6"), seeds=1, runs_dir=tmp_path)
    k2 = next(c.key for c in t2.cells if c.row == "impulse-3" and c.column == ("cifar10",))
    k6 = next(c.key for c in t6.cells if c.row == "pe-pe" and c.column == ("different", "h3", "imp3"))
    assert k2 == k6
    assert len({c.key for c in t6.cells}) == 72  # every other Table 6 cell is a run of its own
    # execution settings do not change a key
    t2b = expand(load_grid("table2"), seeds=1, runs_dir=tmp_path / "elsewhere", overrides=["threads=3", "device=cpu"],
                 data_root=tmp_path / "data")
    assert [c.key for c in t2b.cells] == [c.key for c in t2.cells]


def test_data_dirs_are_read_below_the_data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTINIT_DATA", str(tmp_path / "env-data"))
    t2 = expand(load_grid("table2"), seeds=1)
    imagenet = next(c.config for c in t2.cells if c.column == ("imagenet",))
    cifar = next(c.config for c in t2.cells if c.column == ("cifar10",))
    assert imagenet.data_dir == str(tmp_path / "env-data" / "imagenet") and cifar.data_dir is None
    t2 = expand(load_grid("table2"), seeds=1, data_root=tmp_path / "root")
    cifar = next(c.config for c in t2.cells if c.column == ("cifar10",))
    assert cifar.data_dir == str(tmp_path / "root")


def test_prepare_writes_the_manifest_and_each_runs_config(tmp_path):
    ex = expand(mini(), runs_dir=tmp_path / "runs", command="structinit bench grid mini.toml")
    todo = prepare_runs(ex)
    assert len(todo) == 8
    doc = json.loads(ex.manifest_path.read_text())
    assert ex.manifest_path.parent == tmp_path / "runs" / "grids" and doc["command"].endswith("mini.toml")
    back = Expansion.from_manifest(doc, tmp_path / "runs")
    assert [(c.row, c.column, c.seed, c.key) for c in back.cells] == [(c.row, c.column, c.seed, c.key)
                                                                      for c in ex.cells]
    assert back.spec.baseline == "tn" and back.column_label(("small",)) == "small"
    for cell in todo:
        cfg = read_run_config(ex.run_dir(cell))
        assert cfg.key == cell.key and cfg.train_size == cell.config.train_size
    # preparing again changes nothing and finds the same runs to do
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*.json")}
    assert [c.key for c in prepare_runs(ex)] == [c.key for c in todo]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*.json")} == before


def test_a_hand_edited_config_is_refused(tmp_path):
    ex = expand(mini(), runs_dir=tmp_path)
    cell = prepare_runs(ex)[0]
    path = ex.run_dir(cell) / "config.json"
    doc = json.loads(path.read_text())
    doc["config"]["epochs"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(StructinitError, match="describes run .* not the run .* its folder is named by"):
        read_run_config(ex.run_dir(cell))


def test_impulse_artifacts_are_the_ones_train_asks_for(tmp_path):
    ex = expand(load_grid("digits"), seeds=2, runs_dir=tmp_path)
    solves = init_solves(ex.cells)
    # default impulse and the authors' 2024 code (the released recipe, shared), two seeds each; one
    # artifact per (recipe, seed) for all sizes; impulse-2025 is solved in closed form by each run
    assert len(solves) == 4
    assert {(s.recipe, s.share, s.seed, tuple(s.grid), s.dim, s.heads, s.layers) for s in solves} == {
        (r, share, seed, (8, 8), 64, 4, 4) for r, share in (("fast", False), ("released", True)) for seed in (0, 1)}


@pytest.mark.slow
def test_printed_commands_reproduce_the_run_keys(tmp_path, cli, monkeypatch):
    """Every printed `structinit train` command, parsed by the real CLI, gives the config of its run."""
    import structinit.training.loop as loop

    seen = []

    def fake_train(config, **_):
        seen.append(config)
        raise StructinitError("captured")

    monkeypatch.setattr(loop, "train", fake_train)
    ex = expand(load_grid("digits"), seeds=1, runs_dir=tmp_path / "runs",
                overrides=["eval_every=3", "init_params.share=true"])
    cmds = print_commands(ex, ex.unique_cells())
    assert len(cmds) == 36
    for cmd, cell in zip(cmds, ex.unique_cells()):
        argv = shlex.split(cmd["command"])
        assert argv[:2] == ["structinit", "train"] and argv[-3:] == ["--out", str(ex.run_dir(cell)), "--resume"]
        r = cli(*argv[1:])
        assert r.returncode == 1 and "captured" in r.stderr
        assert seen[-1].key == cell.key, cmd["command"]
    plain = next(c for c in cmds if "data_fit=0" in c["command"])
    assert "--init-param share=true" in plain["command"] and "--train-size" in plain["command"]
    assert "--init-param mimetic_vproj=false" in plain["command"]
    paper = TrainConfig(model="vit-t", init="impulse", init_params={"recipe": "paper", "recipe_params": {"iters": 20}})
    assert train_command(paper)[-2:] == ["--init-param", 'recipe_params={"iters": 20}']
