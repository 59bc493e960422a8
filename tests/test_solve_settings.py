"""The settings of a solve before anything is solved: recipe parameters (conversion, ranges, the
message that names each), grids and shapes, and the SolveConfig that carries them into the key."""

import pytest
from conftest import says

from structinit.errors import UsageError
from structinit.solver.recipes import RECIPE_DEFAULTS, RECIPES, check_recipe, recipe_params


def usage_message(fn, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return str(exc.value)


def test_recipe_params_fill_defaults_convert_and_skip_none():
    for recipe in RECIPES:
        assert recipe_params(recipe) == RECIPE_DEFAULTS[recipe] and recipe_params(recipe) is not RECIPE_DEFAULTS[recipe]
    got = recipe_params("fast", {"target_mass": None, "ridge": 0.001})  # None means "the default", not "stop"
    assert got == {"target_mass": 0.3, "ridge": 0.001}
    got = recipe_params("released", {"iters": 2000.0, "lr": 1, "norm_every": "50"})
    assert got == {"iters": 2000, "lr": 1.0, "norm_every": 50}
    assert type(got["iters"]) is int and type(got["lr"]) is float and type(got["norm_every"]) is int
    assert recipe_params("fast", {"ridge": 0})["ridge"] == 0.0  # ridge may be zero
    assert recipe_params("fast", {"target_mass": 0.999})["target_mass"] == 0.999
    assert check_recipe("paper") == "paper"


@pytest.mark.parametrize("recipe, overrides, message", [
    ("fast", {"iters": 10}, "recipe 'fast' has no parameter iters (it has: target_mass, ridge)"),
    ("paper", {"iters": 2.5}, "iters of recipe 'paper' must be an integer, got 2.5"),
    ("paper", {"iters": True}, "iters of recipe 'paper' must be an integer, got True"),
    ("paper", {"iters": "many"}, "iters of recipe 'paper' must be an integer, got 'many'"),
    ("paper", {"lr": "fast"}, "lr of recipe 'paper' must be a number, got 'fast'"),
    ("paper", {"lr": False}, "lr of recipe 'paper' must be a number, got False"),
    ("paper", {"iters": float("inf")}, "iters of recipe 'paper' must be an integer, got inf"),
    ("paper", {"lr": float("nan")}, "lr of recipe 'paper' must be finite, got nan"),
    ("closed-form", {"logit": float("-inf")}, "logit of recipe 'closed-form' must be finite, got -inf"),
    ("paper", {"iters": 0}, "iters of recipe 'paper' must be positive, got 0"),
    ("paper", {"lr": -1e-4}, "lr of recipe 'paper' must be positive, got -0.0001"),
    ("fast", {"ridge": -1e-5}, "ridge of recipe 'fast' must be non-negative, got -1e-05"),
    ("fast", {"target_mass": 0}, "target_mass of recipe 'fast' must be positive, got 0"),
    ("fast", {"target_mass": 1}, "target_mass must lie strictly between 0 and 1, got 1.0"),
    ("fast", {"target_mass": 1.5}, "target_mass must lie strictly between 0 and 1, got 1.5"),
    ("magic", {}, "unknown recipe 'magic'; choose one of fast, paper, released, closed-form, authors-2025"),
])
def test_recipe_params_refuse_what_cannot_solve_by_name(recipe, overrides, message):
    assert usage_message(recipe_params, recipe, overrides) == message


def test_recipe_errors_mark_the_parameter_for_the_cli():
    with pytest.raises(UsageError) as exc:
        recipe_params("paper", {"lr": 0})
    assert says(exc.value.render(lambda n: f"--{n}"), "--lr", "'paper'", "positive", "got 0")
    with pytest.raises(UsageError) as exc:
        recipe_params("fast", {"target_mass": 2.0})
    assert exc.value.render(lambda n: f"<{n}>").startswith("<target_mass> must lie")
    with pytest.raises(UsageError) as exc:
        recipe_params("fast", {"nope": 1})
    assert "<nope>" in exc.value.render(lambda n: f"<{n}>")
    with pytest.raises(UsageError) as exc:
        check_recipe("x")
    assert exc.value.render(lambda n: f"<{n}>").startswith("unknown <recipe>")


def test_solve_config_checks_and_normalizes_its_settings():
    from structinit.solver.config import SolveConfig

    base = dict(grid=(4, 4), dim=16, heads=2)
    cfg = SolveConfig(**base, pseudo_input="gaussian", pseudo_input_rest="gaussian")
    assert cfg.pseudo_input_rest is None and cfg == SolveConfig(**base, pseudo_input="gaussian")
    assert (cfg.tokens, cfg.head_dim, cfg.grid.label) == (16, 8, "n16")
    assert SolveConfig(grid=[4, 4], dim=16, heads=2).grid == (4, 4)
    for name, value in (("pseudo_input", "noise"), ("pseudo_input_rest", "noise"), ("padding", "reflect"),
                        ("offset_order", "spiral")):
        assert rendered(SolveConfig, **base, **{name: value}).startswith(f"unknown <{name}> {value!r}; choose one of")
    for seed in (-1, 1.5, True, "0"):
        assert says(rendered(SolveConfig, **base, seed=seed), "<seed>", "non-negative integer", f"got {seed!r}")
    assert rendered(SolveConfig, **base, recipe="magic").startswith("unknown <recipe> 'magic'")
    d = SolveConfig(grid=(12,), dim=8, heads=2, seed=3).to_dict()
    assert d["grid"] == [12] and d["format"] == "structinit/1" and d["params"] == {"target_mass": 0.3, "ridge": 1e-5}
    assert SolveConfig.from_dict(d) == SolveConfig(grid=(12,), dim=8, heads=2, seed=3)
    assert SolveConfig(grid=(12,), dim=8, heads=2).filename.startswith("s12-d8-h2-f3-")
    assert SolveConfig(**base, layers=3, share=True, recipe="paper").describe() == (
        "4x4 grid, dim 16, 2 heads, filter 3, 3 layer(s) shared, recipe paper")
    assert SolveConfig(**base).describe() == "4x4 grid, dim 16, 2 heads, filter 3, 1 layer(s), recipe fast"


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


def test_a_config_describes_its_geometry_in_words_and_in_one_record():
    import numpy as np

    from structinit.solver.config import SolveConfig, embedding_digest

    emb = np.arange(12 * 8, dtype=np.float64).reshape(12, 8) / 7
    digest = embedding_digest(emb)
    assert digest == embedding_digest(emb.astype(np.float32))  # hashed as float32, whatever it came as
    seq = SolveConfig(grid=(12,), dim=8, heads=2, filter=3, causal=True, pos_embed=digest)
    assert seq.describe() == ("sequence of 12, dim 8, 2 heads, filter 3 causal, 1 layer(s), recipe fast, fitted to "
                              f"position embedding {digest[7:19]}")
    assert seq.geometry() == {"ndim": 1, "grid": [12], "tokens": 12, "filter": 3, "padding": "zero", "causal": True,
                              "window": [[0, -2], [0, -1], [0, 0]]}  # a causal window looks back only
    img = SolveConfig(grid=(4, 5), dim=8, heads=2, share=True, layers=3, padding="circular")
    assert img.describe() == "4x5 grid, dim 8, 2 heads, filter 3, 3 layer(s) shared, recipe fast"
    assert img.geometry() == {"ndim": 2, "grid": [4, 5], "tokens": 20, "filter": 3, "padding": "circular",
                              "causal": False, "window": [[dy, dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]}


@pytest.mark.parametrize("settings, message", [
    ({"causal": "yes"}, "causal must be true or false, got 'yes'"),
    ({"pos_embed": 123}, "pos_embed must be an embedding digest 'sha256:<64 hex digits>' (see embedding_digest), "
                         "got 123"),
    ({"pos_embed": "sha256:abc"}, "pos_embed must be an embedding digest 'sha256:<64 hex digits>' (see "
                                  "embedding_digest), got 'sha256:abc'"),
    ({"pseudo_input": "uniform", "pos_embed": "sha256:" + "0" * 64},
     "pos_embed replaces the sin-cos table of a 'pe' pseudo input, but pseudo_input 'uniform' uses no position "
     "embedding"),
])
def test_a_config_refuses_a_mask_or_digest_that_is_not_one(settings, message):
    from structinit.solver.config import SolveConfig

    assert usage_message(SolveConfig, grid=(4, 4), dim=8, heads=2, **settings) == message
