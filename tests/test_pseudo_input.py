import numpy as np
import pytest
from conftest import says

from structinit.errors import UsageError
from structinit.geometry.embedding import PSEUDO_INPUTS, layer_norm, pseudo_input, sincos_2d


def test_sincos_shape_and_values():
    pe = sincos_2d((3, 5), 16)
    assert pe.shape == (15, 16) and pe.dtype == np.float32
    # token (y=2, x=4) is index 14; first frequency is 1: channels sin(x), cos(x), sin(y), cos(y)
    assert pe[14, 0] == pytest.approx(np.sin(4.0), abs=1e-6)
    assert pe[14, 4] == pytest.approx(np.cos(4.0), abs=1e-6)
    assert pe[14, 8] == pytest.approx(np.sin(2.0), abs=1e-6)
    assert pe[14, 12] == pytest.approx(np.cos(2.0), abs=1e-6)
    # frequency j of 4 is 10000^(-j/4) by default (the fixed embedding of MAE and the ViT papers)
    assert pe[14, 1] == pytest.approx(np.sin(4.0 * 10000.0 ** -0.25), abs=1e-6)
    assert pe[14, 15] == pytest.approx(np.cos(2.0 * 10000.0 ** -0.75), abs=1e-6)
    # each (sin, cos) pair has unit norm, so every row has norm sqrt(dim / 2)
    np.testing.assert_allclose(np.linalg.norm(pe, axis=1), np.sqrt(8), rtol=1e-5)
    with pytest.raises(UsageError):
        sincos_2d((4, 4), 18)


@pytest.mark.parametrize("kind", PSEUDO_INPUTS)
def test_pseudo_inputs_are_layer_normed(kind):
    x = pseudo_input(kind, (6, 6), 32, seed=1)
    assert x.shape == (36, 32) and x.dtype == np.float32
    np.testing.assert_allclose(x.mean(1), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(1), 1, atol=1e-3)


def test_noise_is_seeded_and_pe_is_not_noisy():
    a = pseudo_input("pe+gaussian", (4, 4), 16, seed=1)
    assert np.array_equal(a, pseudo_input("pe+gaussian", (4, 4), 16, seed=1))
    assert not np.array_equal(a, pseudo_input("pe+gaussian", (4, 4), 16, seed=2))
    # the default seed is the solve's default (SolveConfig.seed 0): a direct call draws the solve's noise
    assert np.array_equal(pseudo_input("pe+uniform", (4, 4), 16), pseudo_input("pe+uniform", (4, 4), 16, seed=0))
    assert np.array_equal(pseudo_input("pe", (4, 4), 16, seed=1), layer_norm(sincos_2d((4, 4), 16)))
    with pytest.raises(UsageError):
        pseudo_input("laplace", (4, 4), 16)


def test_a_model_embedding_of_the_wrong_shape_is_refused_by_name():
    with pytest.raises(UsageError) as exc:
        pseudo_input("pe", (4, 4), 16, embedding=np.zeros((15, 16)))
    assert says(exc.value.render(lambda n: f"<{n}>"), "<embedding>", "[15, 16]", "expected [16, 16]", "4x4 grid")


def test_a_model_embedding_takes_the_place_of_the_table_under_the_same_noise():
    """``embedding`` stands where the sin-cos table would: ``pe`` is its LayerNorm, ``pe+uniform``
    the LayerNorm of it plus the noise the same seed adds to the table (a sign flip of the
    embedding alone leaves ``pe``'s attention logits unchanged, but not these)."""
    emb = np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32)
    assert np.array_equal(pseudo_input("pe", (4, 4), 16, embedding=emb), layer_norm(emb))
    noise = np.random.default_rng(5).uniform(-1.0, 1.0, size=(16, 16))
    assert np.array_equal(pseudo_input("pe+uniform", (4, 4), 16, seed=5, embedding=emb),
                          layer_norm(emb.astype(np.float64) + noise))
    assert np.array_equal(pseudo_input("pe+uniform", (4, 4), 16, seed=5),
                          layer_norm(sincos_2d((4, 4), 16).astype(np.float64) + noise))


def test_layer_norm_normalizes_the_last_axis_of_any_rank():
    """Each row along the last axis gets mean 0 and variance 1 (up to eps), whatever the leading
    axes: a batch [B, N, D] of tables equals the tables normalized one by one."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 7)) * 4.0 + rng.standard_normal((3, 5, 1))
    y = layer_norm(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-4)
    np.testing.assert_array_equal(y, np.stack([layer_norm(t) for t in x]))
