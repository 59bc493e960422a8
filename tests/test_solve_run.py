"""What a solve says when it refuses before any work: an embedding that is not the one the config
names, and a solve that would not fit in memory (sizes in MiB below a GiB, in GiB from one up)."""

import numpy as np
import pytest
from conftest import says

from structinit.errors import StructinitError, UsageError
from structinit.solver import run
from structinit.solver.config import SolveConfig, embedding_digest

SHAPE = dict(grid=(4, 4), dim=8, heads=2)


def test_an_embedding_must_be_the_one_the_config_names():
    emb = np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
    with pytest.raises(UsageError) as e:
        run.check_embedding(SolveConfig(**SHAPE), emb)
    assert says(str(e.value), "embedding was given", "no pos_embed digest", "embedding_digest(embedding)")
    with pytest.raises(UsageError) as e:
        run.check_embedding(SolveConfig(**SHAPE, pos_embed=embedding_digest(emb + 1)), emb)
    assert says(str(e.value), "not the one", "pos_embed digest")
    run.check_embedding(SolveConfig(**SHAPE, pos_embed=embedding_digest(emb.copy())), emb)  # the same: no error


@pytest.mark.parametrize("need, free, told", [
    (5 * 2 ** 20 + 1, 3 * 2 ** 20, "about 5 MiB of memory on cpu, and only 3 MiB is free"),
    (2 ** 30, 2 ** 30 - 1, "about 1.0 GiB of memory on cpu, and only 1024 MiB is free"),
    (3 * 2 ** 30 + 2 ** 29, 2 ** 31, "about 3.5 GiB of memory on cpu, and only 2.0 GiB is free"),
])
def test_a_solve_that_cannot_fit_is_refused_with_both_sizes(monkeypatch, need, free, told):
    monkeypatch.setattr(run, "estimate_memory", lambda config: need)
    monkeypatch.setattr(run, "available_memory", lambda device: free)
    for recipe, hint in (("fast", "fewer tokens, a smaller dim, or a device with more memory"),
                         ("paper", "the fast recipe needs no N x N maps")):
        config = SolveConfig(**SHAPE, recipe=recipe)
        with pytest.raises(StructinitError) as e:
            run.check_memory(config, "cpu")
        assert says(str(e.value), config.describe(), f"needs {told}", hint)
    monkeypatch.setattr(run, "available_memory", lambda device: need)
    assert run.check_memory(SolveConfig(**SHAPE), "cpu") == need  # exactly enough: solved


def test_the_pseudo_inputs_of_a_solve_on_a_models_embedding():
    """Both pseudo inputs (the first layer's and the rest's) are built on the embedding the config
    names, and a config that names one refuses to build them without it."""
    from structinit.geometry.embedding import pseudo_input

    emb = np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
    config = SolveConfig(**SHAPE, pseudo_input="pe", pseudo_input_rest="pe+uniform", pos_embed=embedding_digest(emb))
    first, rest = run.layer_inputs(config, emb)
    np.testing.assert_array_equal(first, pseudo_input("pe", config.grid, 8, seed=config.seed, embedding=emb))
    np.testing.assert_array_equal(rest, pseudo_input("pe+uniform", config.grid, 8, seed=config.seed + 1, embedding=emb))
    on_sincos = pseudo_input("pe+uniform", config.grid, 8, seed=config.seed + 1)
    assert np.abs(rest - on_sincos).max() > 0.1  # the model's table, not the sin-cos one
    with pytest.raises(UsageError) as e:
        run.layer_inputs(config)
    assert says(str(e.value), f"pos_embed {config.pos_embed[:19]}...", "pass the embedding")
    assert config.pos_embed[:19] == "sha256:" + config.pos_embed[7:19] and len(config.pos_embed) > 19


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))


def free_under_address_limit(limit, meminfo: bool = True):
    """``available_memory('cpu')`` in a fresh interpreter whose address space is capped at ``limit``
    (``None``: not capped); without ``meminfo``, as on a system with no ``/proc/meminfo``."""
    import subprocess
    import sys

    hide = ("import builtins, io; real = builtins.open\n"
            "def fake(path, *a, **k):\n"
            "    if str(path) == '/proc/meminfo': raise FileNotFoundError(2, 'No such file or directory')\n"
            "    return real(path, *a, **k)\n"
            "builtins.open = fake\n") if not meminfo else ""
    cap = "resource.RLIM_INFINITY" if limit is None else str(limit)
    code = (f"{hide}import resource; resource.setrlimit(resource.RLIMIT_AS, ({cap}, resource.RLIM_INFINITY))\n"
            "from structinit.solver.run import available_memory; print(available_memory('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return None if out.stdout.strip() == "None" else int(out.stdout)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_the_memory_free_for_a_cpu_solve_is_what_the_kernel_says_capped_by_an_address_space_limit():
    if mem_available() < 4 * 2 ** 30:
        pytest.skip("needs more than 4 GiB available to cap it below that")
    assert free_under_address_limit(3 * 2 ** 30) == 3 * 2 ** 30
    uncapped = free_under_address_limit(2 ** 50)  # a limit above what there is: what there is
    assert 0.5 * mem_available() < uncapped < 2 ** 50 and uncapped % 1024 == 0
    # a system without /proc/meminfo: the address-space limit alone, or unknown
    assert free_under_address_limit(3 * 2 ** 30, meminfo=False) == 3 * 2 ** 30
    assert free_under_address_limit(None, meminfo=False) is None


@pytest.mark.parametrize("layers, rest, shared, solved", [
    (1, None, True, [0]), (4, None, True, [0]),
    (1, "uniform", True, [0]),      # one layer: the rest's pseudo input has no layer to go to
    (2, "uniform", True, [0, 1]),   # the first layer, and one solve for all that follow
    (3, "uniform", True, [0, 1]),
    (3, "uniform", False, [0, 1, 2]),
])
def test_which_layers_get_their_own_solve(layers, rest, shared, solved):
    config = SolveConfig(**SHAPE, layers=layers, pseudo_input_rest=rest, share=shared)
    assert run.solved_layers(config) == solved


def test_the_memory_estimate_scales_as_each_recipe_holds_its_maps():
    """The dense recipes hold N x N maps for every head of every solved layer (authors-2025: of one
    layer at a time); the fast recipe is O(N D). A ratio of estimates, not their value, is checked."""
    def est(grid=(200, 200), **settings):
        return run.estimate_memory(SolveConfig(grid=grid, **{"dim": 64, "heads": 4, **settings}))

    for recipe in ("paper", "released", "closed-form", "authors-2025"):
        base = est(recipe=recipe)
        assert 15 < base / est(grid=(100, 100), recipe=recipe) < 16.5, recipe  # 4x the tokens: 16x
        assert 1.9 < est(recipe=recipe, heads=8) / base < 2.05, recipe
        assert 0.99 < est(recipe=recipe, dim=128) / base < 1.1, recipe  # N x N dominates D
        assert 0.99 < est(recipe=recipe, layers=4, share=True) / base < 1.05, recipe  # one solve
        per_layer = est(recipe=recipe, layers=4) / base
        assert (0.99 < per_layer < 1.1) if recipe == "authors-2025" else (3.9 < per_layer < 4.05), recipe
    fast = est(grid=(800, 800))
    assert 2.5 < fast / est(grid=(400, 400)) < 4.05  # about linear in N past its fixed buffers
    assert 1.5 < est(grid=(800, 800), dim=128) / fast < 2.05  # ... and in D
    assert est() < est(recipe="paper") / 100
