"""Grid files: the shipped grids (shapes, run counts, the paper's numbers in their cells) and every
kind of mistake in a grid file reported with its line."""

import textwrap

import pytest
from conftest import says

from structinit.experiments.gridspec import (
    GridError,
    load_grid,
    parse_grid_text,
    parse_seeds,
    parse_selection,
    restrict,
    shipped_grids,
)

GOOD = """\
name = "mini"
title = "A small grid"
seeds = 2
rows = "init"
columns = ["train_size"]
baseline = "tn"

[settings]
model = "vit-digits"
dataset = "digits"

[[axes.init]]
id = "tn"
label = "Trunc normal"
init = "trunc-normal"

[[axes.init]]
id = "imp5"
init = "impulse"
init_params = { filter = 5 }

[axes]
train_size = [100, 250]

[paper]
source = "somewhere, Table 9"
values.tn = [50.0, 60.0]
values.imp5 = [55.5, nan]
"""


def parse(text, name="mini"):
    return parse_grid_text(textwrap.dedent(text), "grid.toml", name)


def test_the_shipped_grids_have_the_papers_shapes_and_numbers():
    names = list(shipped_grids())
    assert names == ["digits", "fashion", "fashion-196", "mnist1d", "table1", "table2", "table3", "table4", "table5",
                     "table6", "table7", "vit-t16"]
    runs = {n: load_grid(n).runs for n in names}
    # digits: 9 methods x 4 training-set sizes x 5 seeds; Fashion-MNIST 8 x 5 x 5; the paper's grids at 3 seeds
    # (table2 with conditioned init beside the paper's five)
    assert runs == {"digits": 180, "fashion": 200, "fashion-196": 200, "mnist1d": 100, "table1": 12,
                    "table2": 72, "table3": 60, "table4": 72,
                    "table5": 120, "table6": 216, "table7": 120, "vit-t16": 54}
    t2 = load_grid("table2")
    assert t2.row_axis.value("conditioned").settings == {"init": "conditioned", "init_params": {"base": "model"}}
    assert "conditioned" not in t2.paper  # the newer peer: no number in the paper's table
    assert [c[0].id for c in t2.column_cells()] == ["cifar10", "cifar100", "svhn", "imagenet"]
    assert t2.paper["impulse-3"] == [91.62, 68.81, 97.21, 74.24] and t2.baseline == "trunc-normal"
    v = load_grid("vit-t16")  # 16x16 patches at 224: the stream's content fills it; the subspace against the stream
    assert v.settings["patch"] == 16 and v.settings["image_size"] == 224 and v.baseline == "mimetic"
    assert [x.settings.get("init_params") for x in v.row_axis.values] == [  # one base: trunc normal's, the model's
        None, {"base": "model"}, {"base": "model"}, {"base": "model", "position_subspace": False},
        {"base": "model", "position_subspace": True},
        {"base": "model", "position_subspace": True, "position_dims": 16}]
    t4 = load_grid("table4")  # rows kernel, columns dim x filters (dim outermost)
    assert [tuple(v.id for v in c) for c in t4.column_cells()][:5] == [
        ("256", "trained"), ("256", "random"), ("256", "impulse"), ("256", "box"), ("512", "trained")]
    assert t4.paper["8"][3] == 78.95 and t4.paper["8"][7] == 80.10
    t6 = load_grid("table6")
    assert t6.paper["pe-pe"][7] == 91.24 and t6.paper["pe+u-pe+u"][0] == 89.63
    assert t6.row_axis.value("u-pe").settings["init_params"] == {"pseudo_input": "uniform",
                                                                 "pseudo_input_rest": "pe"}
    assert load_grid("table7").paper["impulse-5"][0] == 83.43
    digits = load_grid("digits")
    sizes = {v.id: v.settings for v in digits.axis("train_size").values}
    # every size gets about 900 optimizer steps: epochs * (n // batch)
    for vid, n in (("100", 100), ("250", 250), ("500", 500), ("all", 1137)):
        s = sizes[vid]
        assert s["epochs"] * (n // s["batch_size"]) == pytest.approx(900, abs=17)
        assert s["warmup_epochs"] == pytest.approx(0.05 * s["epochs"])
    assert digits.settings["val_size"] == 300 and "train_size" not in sizes["all"]
    m1 = load_grid("mnist1d")  # the sequence grid: plain and shuffled positions, the CNN as a row
    assert m1.settings == {"model": "transformer-1d", "dataset": "mnist1d", "val_size": 500, "epochs": 20}
    assert [v.settings for v in m1.axis("data").values] == [{"shuffle_seq": False}, {"shuffle_seq": True}]
    assert m1.row_axis.value("impulse-5-fit").settings["init_params"] == {"base": "model", "filter": 5,
                                                                          "mimetic_vproj": True, "data_fit": 300}
    assert m1.row_axis.value("cnn-1d").settings == {"model": "cnn-1d"}


def test_a_grid_file_parses_into_axes_values_and_layout():
    g = parse(GOOD)
    assert g.name == "mini" and g.seeds == (0, 1) and g.rows == "init" and g.columns == ("train_size",)
    assert [v.id for v in g.axis("train_size").values] == ["100", "250"]
    assert g.axis("train_size").values[1].settings == {"train_size": 250}
    assert g.axis("init").value("imp5").label == "imp5"
    assert g.axis("init").value("imp5").settings == {"init": "impulse", "init_params": {"filter": 5}}
    assert g.paper == {"tn": [50.0, 60.0], "imp5": [55.5, None]} and g.paper_source == "somewhere, Table 9"
    assert g.cells == 4 and g.runs == 8


def test_shorthand_axes_must_be_settings():
    with pytest.raises(GridError) as e:
        parse(GOOD.replace("train_size = [100, 250]", "size = [100, 250]").replace('["train_size"]', '["size"]'))
    assert says(str(e.value), "grid.toml:23", "axis 'size'", "plain values", "training setting")
    with pytest.raises(GridError) as e:
        parse(GOOD.replace("train_size = [100, 250]", 'train_size = [100, "x"]'))
    assert says(str(e.value), "grid.toml:23", "'train_size'", "an integer", "got 'x'")


@pytest.mark.parametrize("edit, message", [
    (('seeds = 2', 'seedz = 2'), r"grid.toml:3: unknown key 'seedz' \(did you mean 'seeds'\?\)"),
    (('model = "vit-digits"', 'modle = "vit-digits"'), r"grid.toml:9: \[settings\] unknown setting 'modle' "
                                                       r"\(did you mean 'model'\?\)"),
    (('init = "trunc-normal"', 'inti = "trunc-normal"'), r"grid.toml:15: axis 'init' value 1: unknown setting "
                                                         r"'inti' \(did you mean 'init'\?\)"),
    (('init_params = { filter = 5 }', 'init_params = 5'), r"grid.toml:20: axis 'init' value 2: 'init_params' must be "
                                                          r"a table"),
    (('dataset = "digits"', 'dataset = 3'), None),  # a number for a string setting is read as text
    (('rows = "init"', 'rows = "inits"'), r"grid.toml:4: unknown axis 'inits' in 'rows' \(did you mean 'init'\?\)"),
    (('columns = ["train_size"]', 'columns = []'), r"axis 'train_size' is in neither rows nor columns"),
    (('baseline = "tn"', 'baseline = "trunc"'), r"grid.toml:6: 'baseline' 'trunc' is not a value of the row axis"),
    (('values.imp5 = [55.5, nan]', 'values.imp = [55.5, nan]'), r"grid.toml:28: \[paper\] row 'imp' is not a value "
                                                                r"of the row axis 'init' \(did you mean 'imp5'\?\)"),
    (('values.tn = [50.0, 60.0]', 'values.tn = [50.0]'), r"grid.toml:27: \[paper\] row 'tn' needs 2 numbers"),
    (('seeds = 2', 'seeds = 0'), r"grid.toml:3: the seed count must be at least 1"),
    (('dataset = "digits"', 'seed = 4'), r"grid.toml:10: \[settings\] 'seed' is set by the launcher"),
    (('dataset = "digits"', 'out = "x"'), r"'out' is set by the launcher, not by the grid \(use --out\)"),
    (('id = "imp5"', 'id = "tn"'), r"grid.toml:17: axis 'init' has the id 'tn' twice"),
    (('title = "A small grid"', 'title = "A small grid'), r"grid.toml:2: .* \(column \d+\)"),
])
def test_mistakes_are_reported_with_their_line(edit, message):
    text = GOOD.replace(*edit)
    assert text != GOOD
    if message is None:
        assert parse(text).settings["dataset"] == "3"
        return
    with pytest.raises(GridError, match=message):
        parse(text)


def test_a_value_needs_an_id_unless_it_sets_its_axis():
    with pytest.raises(GridError) as e:
        parse(GOOD.replace('id = "imp5"\ninit = "impulse"\n', ""))
    assert says(str(e.value), "grid.toml:17", "axis 'init' value 2", "needs an 'id'")
    # a value that sets the setting named like its axis is named by it
    text = GOOD.replace('id = "tn"\n', "").replace('"tn"', '"trunc-normal"')
    g = parse(text.replace("values.tn", "values.trunc-normal"))
    assert g.axis("init").values[0].id == "trunc-normal"


def test_inline_axis_values_report_their_line():
    text = """\
    name = "inline"
    rows = "init"
    [settings]
    dataset = "digits"
    [axes]
    init = [
      { id = "a", init = "mimetic" },
      { id = "b", init = "impulse", epohcs = 3 },
    ]
    """
    with pytest.raises(GridError) as e:
        parse(text)
    assert says(str(e.value), "grid.toml:8", "axis 'init' value 2", "unknown setting 'epohcs'", "'epochs'")


def test_unknown_grid_names_and_files(tmp_path):
    from structinit.experiments.gridspec import shipped_grids

    with pytest.raises(GridError) as e:
        load_grid("digit")
    assert says(str(e.value), "unknown grid 'digit'", "'digits'", ", ".join(shipped_grids()))  # every one, in order
    with pytest.raises(GridError, match="grid file .*nope.toml does not exist"):
        load_grid(str(tmp_path / "nope.toml"))
    f = tmp_path / "mine.toml"
    f.write_text(GOOD.replace('name = "mini"\n', ""))
    assert load_grid(str(f)).name == "mine"  # named by its file


def test_seeds_from_text_and_lists():
    assert parse_seeds("3") == (0, 1, 2) and parse_seeds("0,5,7") == (0, 5, 7) and parse_seeds([4, 2]) == (4, 2)
    assert parse_seeds("5-9") == (5, 6, 7, 8, 9) and parse_seeds(" 3 - 3 ") == (3,) and parse_seeds("0,") == (0,)
    for bad in ("0,0", "x", [], [-1], True, "0", "9-5", "2-", "-3", "1-2-3"):
        with pytest.raises(GridError):
            parse_seeds(bad)
    with pytest.raises(GridError, match="seed 0 alone is 0,"):
        parse_seeds("0")
    with pytest.raises(GridError, match="ends before it starts"):
        parse_seeds("9-5")


def test_only_some_values_keep_their_paper_numbers():
    t5 = load_grid("table5")
    part = restrict(t5, parse_selection(["heads=h8,h32", "init=mimetic,trunc-normal", "dim=512"]))
    assert [tuple(v.id for v in c) for c in part.column_cells()] == [("512", "h8"), ("512", "h32")]
    assert [v.id for v in part.row_axis.values] == ["trunc-normal", "mimetic"]  # the grid's order
    assert part.paper == {"trunc-normal": [87.03, 87.39], "mimetic": [90.75, 89.27]}
    assert part.baseline == "trunc-normal" and part.runs == 2 * 2 * 3
    assert restrict(t5, {"init": ["mimetic"]}).baseline is None  # the baseline row was left out
    with pytest.raises(GridError, match=r"unknown axis 'head' \(did you mean 'heads'\?\)"):
        restrict(t5, {"head": ["h8"]})
    with pytest.raises(GridError) as e:
        restrict(t5, {"heads": ["8"]})
    assert says(str(e.value), "axis 'heads'", "no value '8'", ", ".join(v.id for v in t5.axis("heads").values))
