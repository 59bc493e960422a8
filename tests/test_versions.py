"""Algorithm versions: what a solve recipe and the data fit compute is pinned here, version by
version. A change that moves these numbers changes results, so it needs a new version (in
``RECIPE_VERSIONS`` or ``FIT_VERSIONS``), which changes the artifact and run keys; then record the
new version's numbers here. Speed-ups that change only the last bits stay within the tolerance.
Reports refuse to pool runs that recorded different versions."""

import json

import numpy as np
import pytest
from conftest import error_line, says

from structinit.errors import UsageError
from structinit.solver.config import SolveConfig
from structinit.solver.recipes import RECIPE_VERSIONS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: recipe -> (params, version, [sum |q|, sum |k|, sum |logits| of layer 0 on its pseudo input]).
RECIPES = {
    "fast": ({}, 1, [305.5512, 425.7383, 398.4366]),
    "paper": ({"iters": 50}, 1, [63.9197, 63.2758, 133.8351]),
    "released": ({"iters": 50}, 1, [63.6333, 90.0927, 209.7539]),
    "closed-form": ({}, 1, [172.7206, 177.8327, 5.1442]),
    "authors-2025": ({}, 1, [93.6200, 93.2747, 5.2646]),
}
#: data fit version -> (sum |q,k rows| of layer 3, per-layer target mass on the batch) of a 10-step fit.
FITS = {1: (1183.934, [0.296946, 0.3, 0.292338, 0.299066]),
        2: (1161.841, [0.298227, 0.299961, 0.29031, 0.299994])}


def fingerprint(art):
    x, q, k = art.layer_input(0), art.q[0], art.k[0]
    logits = np.einsum("nD,hDd->hnd", x, q) @ np.einsum("nD,hDd->hnd", x, k).transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    return [float(np.abs(art.q).sum()), float(np.abs(art.k).sum()), float(np.abs(logits).sum())]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_computes_what_its_version_computed(recipe):
    from structinit.solver.run import compute

    params, version, want = RECIPES[recipe]
    assert RECIPE_VERSIONS[recipe] == version, "a new version: record its numbers here"
    config = SolveConfig(grid=(4, 4), dim=16, heads=2, filter=3, layers=2, recipe=recipe, params=params, seed=3)
    assert fingerprint(compute(config, device="cpu")) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("version", sorted(FITS))
def test_each_data_fit_version_computes_what_it_computed(version, tmp_path):
    from structinit.fit.settings import FIT_VERSIONS
    from structinit.init.initialize import initialize_model
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset
    from structinit.training.models import ModelConfig, build_model

    assert version in FIT_VERSIONS
    data = load_dataset("digits")
    x = normalize(data.train.images[:16], data.info.mean, data.info.std)
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0)
    rep = initialize_model(model, "impulse", data=x, seed=0, data_fit=10, data_fit_version=version, cache_dir=tmp_path)
    total, masses = FITS[version]
    assert float(model.blocks[3].attn.qkv.weight.detach()[:128].abs().sum()) == pytest.approx(total, rel=1e-3)
    assert [row["target_mass"] for row in rep["data_fit"]["layers"]] == pytest.approx(masses, abs=2e-4)


def test_a_recipe_version_is_in_the_keys_from_version_2_on(monkeypatch):
    from structinit.init.registry import init_spec
    from structinit.training.config import TrainConfig

    config = SolveConfig(grid=(4, 4), dim=16, heads=2)
    assert config.algorithm == 1 and "algorithm" not in config.to_dict()
    spec = init_spec("impulse")
    assert "algorithms" not in spec.to_dict() and spec.algorithms() == {"recipe fast": 1, "data fit": 2}
    assert init_spec("impulse", data_fit=0).algorithms() == {"recipe fast": 1}
    assert init_spec("impulse-2024").algorithms() == {"recipe released": 1}
    assert init_spec("impulse-2025").algorithms() == {"recipe authors-2025": 1}
    assert init_spec("mimetic").algorithms() == {}
    run = TrainConfig(init="impulse", train_size=100).key
    monkeypatch.setitem(RECIPE_VERSIONS, "fast", 2)  # what a change to the fast recipe's results must do
    bumped = SolveConfig(grid=(4, 4), dim=16, heads=2)
    assert bumped.algorithm == 2 and bumped.to_dict()["algorithm"] == 2 and bumped.key != config.key
    assert init_spec("impulse").to_dict()["algorithms"] == {"recipe fast": 2}
    assert TrainConfig(init="impulse", train_size=100).key != run
    # an artifact of version 1 is still read as what it is; solving version 1 again is refused
    old = SolveConfig.from_dict({k: v for k, v in config.to_dict().items()})
    assert old.algorithm == 1 and old.key == config.key
    from structinit.solver.run import compute

    with pytest.raises(UsageError, match="asks for version 1 of recipe 'fast', and this structinit computes version 2"):
        compute(old, device="cpu")


def test_a_report_refuses_to_pool_runs_of_different_versions(tmp_path, cli):
    """Two seeds of one row, one made before runs recorded their versions: refused without
    --mixed-versions, reported with it; the versions go into runs.csv."""
    from grids import DIGITS, trained_grid, variant

    grid = tmp_path / "grid.toml"
    # trained in this process (bench grid's local launcher would start a process a run)
    trained_grid(tmp_path, variant(DIGITS, name="versions", title="versions", seeds=2, train_size=32, epochs=1,
                                   batch_size=16, axes='[[axes.init]]\nid = "mimetic"\ninit = "mimetic"\n'))
    ok = cli("bench", "report", grid, "--out", tmp_path / "runs", "--json")
    assert ok.returncode == 0, ok.stderr
    runs = json.loads(ok.stdout)["grids"][0]["runs"]
    assert [run["algorithms"] for run in runs] == ["none", "none"]
    old = tmp_path / "runs" / runs[1]["key"] / "config.json"
    doc = json.loads(old.read_text())
    del doc["algorithms"]  # as a run made before versions were recorded
    old.write_text(json.dumps(doc))
    r = cli("bench", "report", grid, "--out", tmp_path / "runs")
    assert r.returncode == 2 and says(error_line(r.stderr), "row mimetic", "different algorithm versions",
                                      "none (seeds 0)", "not recorded (seeds 1)", "--mixed-versions")
    r = cli("bench", "report", grid, "--out", tmp_path / "runs", "--mixed-versions", "--report-dir", tmp_path / "rep")
    assert r.returncode == 0, r.stderr
    assert "algorithms" in (tmp_path / "rep" / "runs.csv").read_text().splitlines()[0]
