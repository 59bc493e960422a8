"""The authors' exact recipes, constant by constant: the ``authors-2025`` solver recipe and the init
methods ``impulse-2024`` (the released code of "Structured Initialization for Attention in Vision
Transformers") and ``impulse-2025`` (the code of "Structured Initialization for Vision
Transformers"). Expected values are computed here independently (NumPy, literal constants, the
model's own modules), not with the functions under test."""

import math

import numpy as np
import pytest
import torch
from conftest import error_line, says
from timm.models.vision_transformer import VisionTransformer  # imported once, not inside the first test

from structinit.errors import StructinitError, UsageError
from structinit.geometry.targets import draw_offsets
from structinit.init.initialize import initialize, initialize_model
from structinit.init.registry import init_spec, spec_from_dict
from structinit.solver.algorithms import (
    authors_2025_logits,
    dense_targets,
    lowrank_logit_fit,
    rank_d_pinv,
    solve_authors_2025,
    solve_closed_form,
    trunc_normal,
)
from structinit.solver.recipes import recipe_params

#: The 2025 code's kernel positions, head h -> ORDER[h % 9], row-major in the 3x3 kernel.
ORDER = [4, 1, 5, 3, 7, 0, 2, 6, 8]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def vit(grid=8, dim=32, heads=4, depth=2, garbage=True):
    """A tiny timm ViT (patch 1, no class token, average pooling) with every parameter set to 3.0, so
    that whatever the init leaves at PyTorch's default must have been reset by it."""
    m = VisionTransformer(img_size=grid, patch_size=1, in_chans=1, num_classes=10, embed_dim=dim, depth=depth,
                          num_heads=heads, mlp_ratio=2, class_token=False, global_pool="avg")
    if garbage:
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(3.0)
    return m


def qk_of(model, layer, heads):
    """``(Q, K)`` ``[H, D, d]`` straight from the fused qkv weight (rows ``h*d:(h+1)*d`` are ``Q_h^T``)."""
    w = model.blocks[layer].attn.qkv.weight.detach().double()
    dim = w.shape[1]
    d = dim // heads
    return (w[:dim].reshape(heads, d, dim).transpose(1, 2), w[dim:2 * dim].reshape(heads, d, dim).transpose(1, 2))


def authors_offsets(heads):
    return [(ORDER[h % 9] // 3 - 1, ORDER[h % 9] % 3 - 1) for h in range(heads)]


def target_columns(grid, offsets):
    """Token (y, x) targets (y + dy, x + dx), -1 outside the grid (written out here, not imported)."""
    h, w = grid
    out = np.full((len(offsets), h * w), -1)
    for i, (dy, dx) in enumerate(offsets):
        for y in range(h):
            for x in range(w):
                if 0 <= y + dy < h and 0 <= x + dx < w:
                    out[i, y * w + x] = (y + dy) * w + x + dx
    return out


def np_layer_norm(x, eps):
    x = np.asarray(x, dtype=np.float64)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def np_rank_d_pinv(p, d):
    """(P^T P)^+_d P^T from the eigendecomposition of P^T P, keeping the d largest eigenvalues."""
    ev, vec = np.linalg.eigh(p.T @ p)
    top = np.argsort(ev)[::-1][:d]
    return vec[:, top] @ np.diag(1.0 / ev[top]) @ vec[:, top].T @ p.T


def np_qk_product(p, w, d, scale=7.0):
    """``Q_h K_h^T`` of the 2025 closed form for logits ``w [H, N, N]`` (sign-free: ``U_d S_d V_d^T``
    times ``scale^2 / sum(S_d)``, both factors having Frobenius norm ``scale``)."""
    pinv = np_rank_d_pinv(p, d)
    out = []
    for wh in w:
        u, s, vt = np.linalg.svd(pinv @ wh @ pinv.T)
        out.append(u[:, :d] @ np.diag(s[:d]) @ vt[:d] * scale ** 2 / s[:d].sum())
    return np.stack(out)


def hit_rate_through_the_model(model, layer, heads, offsets):
    """Hit rate per head of layer ``layer``'s attention on its LayerNorm'd position embedding,
    computed with the model's own qkv Linear (biases included), as timm's attention does."""
    return measured_through_the_model(model, layer, heads, offsets, prefix=0)[0]


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


# --------------------------------------------------------------------------- the authors-2025 recipe

def test_authors_2025_recipe_constants():
    assert recipe_params("authors-2025") == {"logit": 1000.0, "noise_scale": 3.0, "noise_std": 0.6,
                                             "noise_bound": 2.0, "qk_scale": 7.0}
    # the project's own variant keeps its constants (and so its artifact keys)
    assert recipe_params("closed-form") == {"logit": 10.0, "noise_std": 1.0, "qk_scale": 7.0}


def test_target_logits_are_1000_on_impulses_and_truncated_normal_noise_elsewhere():
    offsets = authors_offsets(4)
    cols = torch.from_numpy(target_columns((8, 8), offsets))
    w = authors_2025_logits(cols, torch.Generator().manual_seed(0),
                            **{k: v for k, v in recipe_params("authors-2025").items() if k != "qk_scale"})
    impulse = torch.zeros_like(w, dtype=torch.bool)
    for h in range(4):
        for row, col in enumerate(cols[h].tolist()):
            if col >= 0:
                impulse[h, row, col] = True
    assert int(impulse.sum()) == int((cols >= 0).sum()) == 4 * 64 - (0 + 8 + 8 + 8)  # head 0 is the identity
    assert torch.all(w[impulse] == 1000.0)
    noise = w[~impulse]
    # 3 x N(0, 0.6) truncated to [-2, 2]: std 3 * 0.6 * sqrt(1 - 2 b phi(b) / (2 Phi(b) - 1)), b = 2 / 0.6
    b = 2.0 / 0.6
    phi, mass = math.exp(-b * b / 2) / math.sqrt(2 * math.pi), math.erf(b / math.sqrt(2))
    std = 3 * 0.6 * math.sqrt(1 - 2 * b * phi / mass)
    assert std == pytest.approx(1.7907, abs=1e-4)
    assert float(noise.std()) == pytest.approx(std, rel=0.03)
    assert abs(float(noise.mean())) < 0.05
    assert float(noise.abs().max()) <= 6.0
    # truncated (redrawn inside), not clamped: clamping N(0, 0.6) at 2 would put ~14 of these exactly on +-6
    assert int((noise.abs() == 6.0).sum()) == 0
    more = trunc_normal((400_000,), 0.6, 2.0, torch.Generator().manual_seed(1))
    assert int((more.abs() == 2.0).sum()) == 0 and float(more.abs().max()) <= 2.0  # clamping: ~340 on the bound
    near = float(((more.abs() > 1.8) & (more.abs() <= 2.0)).double().mean())
    want = (math.erf(b / math.sqrt(2)) - math.erf(1.8 / 0.6 / math.sqrt(2))) / mass
    assert near == pytest.approx(want, rel=0.15)
    # fresh noise on every call (the 2025 code re-draws it for every layer), the impulses stay
    g = torch.Generator().manual_seed(0)
    a, b2 = authors_2025_logits(cols, g), authors_2025_logits(cols, g)
    assert torch.equal(a[impulse], b2[impulse]) and not torch.equal(a, b2)


def test_trunc_normal_draws_what_timm_draws_from_the_same_generator_state():
    """Draw for draw timm's ``trunc_normal_`` (the authors' code calls it): the same uniform draws
    mapped through the same CDF range, so a shifted range or a lost factor shows in the values."""
    from timm.layers import trunc_normal_

    torch.manual_seed(5)
    want = trunc_normal_(torch.empty(2000, dtype=torch.float64), std=0.6, a=-2.0, b=2.0)
    got = trunc_normal((2000,), 0.6, 2.0, torch.Generator().manual_seed(5))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.manual_seed(6)  # a bound the draws reach often: the range's both ends are in use
    want = trunc_normal_(torch.empty(2000, dtype=torch.float64), std=1.0, a=-0.5, b=0.5)
    got = trunc_normal((2000,), 1.0, 0.5, torch.Generator().manual_seed(6))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert float(got.min()) < -0.49 and float(got.max()) > 0.49


def test_rank_d_pseudo_inverse_is_the_formula():
    rng = np.random.default_rng(0)
    p = np_layer_norm(rng.standard_normal((64, 32)) * 0.36, 1e-5)
    want = np_rank_d_pinv(p, 8)
    got = rank_d_pinv(torch.from_numpy(p), 8).numpy()
    assert got.shape == (32, 64)
    np.testing.assert_allclose(got, want, atol=1e-10)
    assert not np.allclose(got, np.linalg.pinv(p), atol=1e-3)  # not the full pseudo-inverse
    # P+ P is the projector onto the top-8 principal directions of P
    proj = got @ p
    np.testing.assert_allclose(proj @ proj, proj, atol=1e-10)
    assert np.trace(proj) == pytest.approx(8.0)


def test_rank_d_pseudo_inverse_of_a_batch_is_each_ones():
    """``p [..., N, D]``: a batch of inputs gives each input's own pseudo-inverse."""
    rng = np.random.default_rng(3)
    p = torch.from_numpy(np.stack([np_layer_norm(rng.standard_normal((40, 16)), 1e-5) for _ in range(3)]))
    got = rank_d_pinv(p, 4)
    assert got.shape == (3, 16, 40)
    for b in range(3):
        torch.testing.assert_close(got[b], rank_d_pinv(p[b], 4), rtol=0, atol=1e-10)


def test_rank_d_pseudo_inverse_drops_only_the_directions_p_does_not_have():
    """Singular values of ``P^T P`` under ``rcond^2`` times the largest count as zero, the rest
    are kept: with singular values 1000 x (1, 1, 1, 1e-4, 0, ...) of ``P`` and ``d = 8``, ``P+ P``
    projects onto exactly the four directions ``P`` has (the fourth at 1e-8 of the largest in
    ``P^T P``, far above the cut-off; the zero ones at rounding level, far below it)."""
    rng = np.random.default_rng(4)
    u, _ = np.linalg.qr(rng.standard_normal((40, 16)))
    v, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    sv = 1000.0 * np.array([1, 1, 1, 1e-4] + [0] * 12)
    p = (u * sv) @ v.T
    proj = (rank_d_pinv(torch.from_numpy(p), 8) @ torch.from_numpy(p)).numpy()
    np.testing.assert_allclose(proj, v[:, :4] @ v[:, :4].T, atol=1e-6)


@pytest.mark.parametrize("params", [{}, dict(logit=50.0, noise_scale=2.0, noise_std=0.4, noise_bound=0.5,
                                             qk_scale=3.0)])
def test_solve_is_the_authors_closed_form_with_factors_at_norm_7(params):
    """With the authors' constants (factors at norm 7), and with other ones, each of which must
    reach the construction; progress is reported after each layer."""
    rng = np.random.default_rng(1)
    p = np_layer_norm(rng.standard_normal((64, 32)) * 0.36, 1e-5)
    cols = torch.from_numpy(target_columns((8, 8), authors_offsets(4)))
    x = torch.from_numpy(p).unsqueeze(0).expand(2, -1, -1)
    calls = []
    q, k = solve_authors_2025(x, cols.unsqueeze(0).expand(2, -1, -1), 8, 4, torch.Generator().manual_seed(5),
                              progress=lambda i, n: calls.append((i, n)), **params)
    assert calls == [(1, 2), (2, 2)]
    scale = params.get("qk_scale", 7.0)
    assert q.shape == k.shape == (2, 4, 32, 8)
    np.testing.assert_allclose(q.double().norm(dim=(-2, -1)).numpy(), scale, atol=1e-5)
    np.testing.assert_allclose(k.double().norm(dim=(-2, -1)).numpy(), scale, atol=1e-5)
    g = torch.Generator().manual_seed(5)  # the same noise, layer after layer
    logit_params = {name: v for name, v in params.items() if name != "qk_scale"}
    for layer in range(2):
        w = authors_2025_logits(cols, g, **logit_params).numpy()
        want = np_qk_product(p, w, 8, scale)
        got = (q[layer].double() @ k[layer].double().transpose(-1, -2)).numpy()
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    assert not torch.allclose(q[0], q[1], atol=1e-3)  # fresh noise per layer


def test_closed_form_is_its_documented_construction():
    """``closed-form``: ``logit`` on impulse entries, a standard normal clamped at +-2 times
    ``noise_std`` elsewhere (drawn in float64 from ``generator``), the low-rank fit, each factor at
    norm ``qk_scale``."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(np_layer_norm(rng.standard_normal((2, 36, 16)), 1e-5))
    cols = torch.from_numpy(target_columns((6, 6), authors_offsets(4))).unsqueeze(0).expand(2, -1, -1)
    calls = []
    q, k = solve_closed_form(x, cols, 4, 4, torch.Generator().manual_seed(1), logit=6.0, noise_std=0.5, qk_scale=3.0,
                             progress=lambda i, n: calls.append((i, n)))
    assert calls == [(1, 1)]  # one step for all layers
    noise = torch.randn((2, 4, 36, 36), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert float(noise.abs().max()) > 2.5  # the clamp matters
    logits = torch.where(dense_targets(cols, 36) > 0, 6.0, noise.clamp(-2, 2) * 0.5)
    wq, wk = lowrank_logit_fit(x, logits, 4)
    torch.testing.assert_close(q, (wq / wq.norm(dim=(-2, -1), keepdim=True) * 3.0).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(k, (wk / wk.norm(dim=(-2, -1), keepdim=True) * 3.0).float(), rtol=0, atol=1e-6)


def test_a_layer_with_another_pseudo_input_gets_its_own_pseudo_inverse():
    """The pseudo-inverse is reused only while a layer's input equals the one before: layers 1-2 of a
    solve on (p0, p1, p1) are those of a solve on p1 throughout, layer 0 that of one on p0 (the
    noise is drawn layer after layer either way, so the same seed gives the same noise)."""
    rng = np.random.default_rng(2)
    p0, p1 = (torch.from_numpy(np_layer_norm(rng.standard_normal((64, 32)) * 0.36, 1e-5)) for _ in range(2))
    cols = torch.from_numpy(target_columns((8, 8), authors_offsets(4))).unsqueeze(0).expand(3, -1, -1)

    def solve(*inputs):
        return solve_authors_2025(torch.stack(inputs), cols, 8, 4, torch.Generator().manual_seed(5))

    mixed, only0, only1 = solve(p0, p1, p1), solve(p0, p0, p0), solve(p1, p1, p1)
    for got, want in zip(mixed, only0):  # q, then k
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for got, want in zip(mixed, only1):
        torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=1e-6)
    assert not torch.allclose(only0[0][1], only1[0][1], atol=1e-3)  # the inputs do give other Q


# --------------------------------------------------------------------------- impulse-2025

@pytest.mark.parametrize("heads, dim", [(9, 36), (12, 48)])
def test_2025_offsets_follow_the_authors_order(heads, dim):
    m = vit(grid=4, dim=dim, heads=heads, depth=2)
    report = initialize_model(m, "impulse-2025", seed=0)
    want = [list(o) for o in authors_offsets(heads)]
    assert want[:9] == [[0, 0], [-1, 0], [0, 1], [0, -1], [1, 0], [-1, -1], [-1, 1], [1, -1], [1, 1]]
    assert [r["offsets"] for r in report["layers"]] == [want, want]
    if heads == 12:
        assert want[9:] == want[:3]


def test_2025_model_pe_qk_and_vproj_are_the_authors():
    m = vit(grid=8, dim=32, heads=4, depth=2)
    report = initialize_model(m, "impulse-2025", seed=3)
    pe = m.pos_embed
    # PE: 18 x 0.02 x randn, learnable
    assert isinstance(pe, torch.nn.Parameter) and pe.requires_grad
    assert float(pe.detach().std()) == pytest.approx(0.36, rel=0.05)
    assert abs(float(pe.detach().mean())) < 0.03
    assert report["pos_embed"]["learnable"] is True and report["pos_embed"]["std"] == pytest.approx(
        float(pe.detach().std()))
    # Q/K: every head's factors at Frobenius norm 7; layers differ, offsets shared
    q0, k0 = qk_of(m, 0, 4)
    q1, k1 = qk_of(m, 1, 4)
    for w in (q0, k0, q1, k1):
        np.testing.assert_allclose(w.norm(dim=(-2, -1)).numpy(), 7.0, atol=1e-5)
    assert (q0 - q1).abs().max() > 1e-2 and report["layers"][0]["offsets"] == report["layers"][1]["offsets"]
    # Q and K live in the top-d principal subspace of the LayerNorm'd PE (not of the raw one)
    p = np_layer_norm(pe.detach()[0].numpy(), 1e-5)
    ev, vec = np.linalg.eigh(p.T @ p)
    top = vec[:, np.argsort(ev)[::-1][:8]]
    for w in (q0, k0):
        w = w.numpy()
        assert np.abs(top @ (top.T @ w) - w).max() < 1e-4 * np.abs(w).max()
    # and Q_0 K_0^T is the closed form computed here from the model's PE and the same noise draws
    # (one generator seeded with the seed: the PE first, then per layer the logits, then V/proj's Z)
    g = torch.Generator().manual_seed(3)
    torch.randn(pe.shape, generator=g)
    cols = torch.from_numpy(target_columns((8, 8), authors_offsets(4)))
    want = np_qk_product(p, authors_2025_logits(cols, g).numpy(), 8)
    got = (q0 @ k0.transpose(-1, -2)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    # V/proj: x W_V W_proj = x (0.4 Z - 0.4 I) with Z uniform in +-sqrt(3/D), fresh per layer
    zs = []
    for blk in m.blocks:
        w_v = blk.attn.qkv.weight.detach().double()[64:].T  # x @ W convention
        w_p = blk.attn.proj.weight.detach().double().T
        z = ((w_v @ w_p) + 0.4 * torch.eye(32, dtype=torch.float64)) / 0.4
        bound = math.sqrt(3 / 32)
        assert float(z.abs().max()) <= bound + 1e-5 and float(z.abs().max()) > 0.95 * bound
        assert float(z.std()) == pytest.approx(math.sqrt(1 / 32), rel=0.08)
        zs.append(z)
    assert (zs[0] - zs[1]).abs().max() > 0.1
    assert report["layers"][0]["vproj_diag_mean"] == pytest.approx(-0.4, abs=0.05)
    # the same seed gives the same model, another seed another PE
    again = vit()
    initialize_model(again, "impulse-2025", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), again.state_dict().values()))
    other = vit()
    initialize_model(other, "impulse-2025", seed=4)
    assert not torch.equal(other.pos_embed, m.pos_embed)


def test_2025_report_measures_the_model_itself():
    m = vit(grid=8, dim=64, heads=4, depth=2)
    report = initialize_model(m, "impulse-2025", seed=0)
    assert report["method"] == "impulse-2025" and report["recipe"] == "authors-2025" and report["shared"] is False
    assert report["paper"] == "Structured Initialization for Vision Transformers"
    assert report["not_reset"] == ["pos_embed"]
    assert {"patch_embed.proj (Conv2d)", "blocks.0.attn.qkv (Linear)", "blocks.1.mlp.fc2 (Linear)",
            "blocks.0.norm1 (LayerNorm)", "fc_norm (LayerNorm)", "head (Linear)"} <= set(report["reset"])
    row = report["layers"][0]
    assert row["replaced"] == ["blocks.0.attn.qkv.weight[0:64]", "blocks.0.attn.qkv.weight[64:128]",
                               "blocks.0.attn.qkv.weight[128:192]", "blocks.0.attn.proj.weight"]
    assert row["qk_fro"] == pytest.approx([7.0] * 4, abs=1e-5)
    for layer in range(2):
        want = hit_rate_through_the_model(m, layer, 4, authors_offsets(4))
        assert report["layers"][layer]["heads"]["hit_rate"] == pytest.approx(want, abs=1e-6)
        assert report["layers"][layer]["hit_rate"] == pytest.approx(np.mean(want), abs=1e-6)
    assert report["layers"][0]["heads"]["hit_rate"][0] > 0.9  # head 0 attends to itself
    assert 0 < report["target_mass"] < 1


# --------------------------------------------------------------------------- impulse-2024

def test_2024_one_shared_solve_random_offsets_with_repeats_vproj_untouched():
    m = vit(grid=4, dim=36, heads=9, depth=3)
    report = initialize_model(m, "impulse-2024", seed=0, recipe_params={"iters": 100})
    offsets = [r["offsets"] for r in report["layers"]]
    assert offsets[0] == offsets[1] == offsets[2]
    assert len({tuple(o) for o in offsets[0]}) < 9  # drawn with replacement: this seed repeats some
    q0, k0 = qk_of(m, 0, 9)
    for layer in (1, 2):
        q, k = qk_of(m, layer, 9)
        assert torch.equal(q, q0) and torch.equal(k, k0)
    config = report["artifact"]["config"]
    assert config["recipe"] == "released" and config["share"] is True and config["offset_order"] == "random"
    assert config["params"] == {"iters": 100, "lr": 1e-4, "norm_every": 100}
    # the fixed sin-cos table, frozen
    from structinit.geometry.embedding import sincos_2d

    assert not m.pos_embed.requires_grad
    np.testing.assert_allclose(m.pos_embed.detach()[0].numpy(), sincos_2d((4, 4), 36), atol=1e-6)
    # every other weight, V/proj and the Q/K biases included, is what PyTorch's reset gives
    ref = vit(grid=4, dim=36, heads=9, depth=3)
    torch.manual_seed(0)
    for module in ref.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    got, want = m.state_dict(), ref.state_dict()
    for key in want:
        if key == "pos_embed":
            continue
        if key.endswith("qkv.weight"):
            assert torch.equal(got[key][72:], want[key][72:]), key  # V rows untouched
            assert not torch.equal(got[key][:72], want[key][:72]), key  # Q/K rows solved
        else:
            assert torch.equal(got[key], want[key]), key
    assert report["vproj"].startswith("not written")


def test_2024_defaults_are_the_released_code():
    spec = init_spec("impulse-2024")
    config = spec.impulse_spec().solve_config((8, 8), 64, 4, 4, seed=0)
    assert config.recipe == "released" and config.share and config.offset_order == "random"
    assert config.params == {"iters": 10000, "lr": 1e-4, "norm_every": 100}
    assert config.pseudo_input == "pe" and config.padding == "zero" and config.filter == 3


def test_random_offsets_are_uniform_with_replacement():
    offs = draw_offsets(3, 9000, 1, seed=0, order="random")[0]
    ks = (offs[:, 0] + 1) * 3 + (offs[:, 1] + 1)
    freq = np.bincount(ks, minlength=9) / len(ks)
    np.testing.assert_allclose(freq, 1 / 9, atol=0.015)
    repeats = sum(len({tuple(o) for o in draw_offsets(3, 9, 1, seed=s)[0]}) < 9 for s in range(20))
    assert repeats == 20  # 9 draws from 9 positions repeat with probability 1 - 9!/9^9 = 0.999


# --------------------------------------------------------------------------- both

@pytest.mark.parametrize("method, params", [("impulse-2025", {}), ("impulse-2024", {"recipe_params": {"iters": 50}})])
def test_other_weights_are_at_pytorch_defaults(method, params):
    m = vit(grid=4, dim=32, heads=4, depth=2)
    initialize_model(m, method, seed=1, **params)
    for name, module in m.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and not name.endswith(("attn.qkv", "attn.proj")):
            fan_in = module.weight[0].numel()
            bound = 1 / math.sqrt(fan_in)
            w = module.weight.detach()
            assert float(w.abs().max()) <= bound, name
            if w.numel() >= 256:  # uniform: std bound / sqrt(3)
                assert float(w.std()) == pytest.approx(bound / math.sqrt(3), rel=0.15), name
            assert float(module.bias.detach().abs().max()) <= bound, name
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0), name
    for blk in m.blocks:  # biases of q, k, v and proj: PyTorch's default too (the authors' code keeps them)
        assert float(blk.attn.qkv.bias.detach().abs().max()) <= 1 / math.sqrt(32)
        assert float(blk.attn.qkv.bias.detach()[:64].abs().min()) > 0  # not zeroed
        assert float(blk.attn.proj.bias.detach().abs().max()) <= 1 / math.sqrt(32)


def test_specs_round_trip_and_refuse_what_the_code_does_not_have(tmp_path):
    for spec in (init_spec("impulse-2025"), init_spec("impulse-2024", recipe_params={"iters": 5})):
        assert spec_from_dict(spec.to_dict()) == spec
    assert says(rendered(init_spec, "impulse-2025", filter=5), "impulse-2025", "<filter>", "must be 3", "3x3 kernel",
                "got 5")
    assert says(rendered(init_spec, "impulse-2025", recipe="fast"), "'impulse-2025'", "no parameter <recipe>",
                "it takes: filter")
    assert says(rendered(init_spec, "impulse-2024", recipe_params={"logit": 3}), "'released'", "no parameter <logit>",
                "iters, lr, norm_every")
    assert says(rendered(init_spec, "impulse-2024", filter=0), "impulse-2024", "<filter>", "positive", "got 0")
    assert says(rendered(recipe_params, "authors-2025", {"noise_std": 0}), "<noise_std>", "'authors-2025'", "positive",
                "got 0")
    from structinit.init.mimetic import mimetic_v_proj

    assert says(rendered(mimetic_v_proj, 8, 0.4, 0.4, torch.Generator(), dist="cauchy"), "unknown <dist> 'cauchy'",
                "normal, uniform")
    sd = vit(grid=4, garbage=False).state_dict()
    for method in ("impulse-2024", "impulse-2025"):
        assert says(rendered(initialize, sd, method, heads=4), method, "reset_parameters()", "needs the model",
                    "not a state dict", "initialize_model", "apply")
    from structinit.training.sequence_models import SequenceTransformer

    seq = SequenceTransformer(length=16, in_chans=1, num_classes=10, dim=32, depth=1, heads=4)
    assert says(rendered(initialize_model, seq, "impulse-2025"), "impulse-2025", "3x3 kernel", "image grid",
                "<grid>", "sequence of 16")


def test_apply_runs_the_recipe_through_the_checkpoints_model(tmp_path, cli):
    """Issue 52: apply built no model for the authors' recipes and sent the user to Python. It now runs
    them on the model the checkpoint describes, as initialize_model does on that model, and writes
    every weight back: the same Q/K, position embedding and reset weights as initialize_model."""
    path = tmp_path / "vit.pth"
    source = vit(grid=4)  # every parameter 3.0: whatever is not reset stays visible
    torch.save(source.state_dict(), path)
    r = cli("apply", path, "--method", "impulse-2025", "--heads", "4")
    assert r.returncode == 0, r.stderr
    written = torch.load(tmp_path / "vit.impulse-2025.pth", weights_only=True)
    model = vit(grid=4)
    initialize_model(model, "impulse-2025", seed=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(written[name], value, msg=name)
    assert "tensors changed: " in r.stdout and "blocks.{0-1}.mlp.fc1.weight" in r.stdout
    r = cli("apply", path, "--method", "impulse-2025", "--model", "vit_tiny_patch16_224", "--out", tmp_path / "x.pth")
    assert r.returncode == 2 and "dim 32" in error_line(r.stderr) and not (tmp_path / "x.pth").exists()


def test_train_keeps_the_2025_position_embedding_learnable(tmp_path):
    from structinit.training.config import TrainConfig
    from structinit.training.loop import train

    out = tmp_path / "run"
    result = train(TrainConfig(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, lr=1e-2,
                               warmup_epochs=0.5, batch_size=32, train_size=64, epochs=1, threads=1,
                               init="impulse-2025", out=str(out)))
    report = result.init_report
    assert report["method"] == "impulse-2025" and report["pos_embed"]["learnable"] is True
    assert result.params["trainable"] == result.params["total"]  # the PE trains
    assert report["data_attention"]["samples"] == 64 and 0 <= report["data_attention"]["hit_rate"] <= 1
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    trained = ck["state_dict"]["pos_embed"]
    fresh = vit(grid=4, dim=32, heads=2, depth=1)
    assert trained.shape == fresh.pos_embed.shape
    # the embedding the init wrote, recomputed: 18 x 0.02 x randn from the seed's generator
    start = torch.randn(trained.shape, generator=torch.Generator().manual_seed(0)) * 0.36
    assert not torch.equal(trained, start) and float((trained - start).abs().max()) < 0.1  # it moved, a little


def test_authors_2025_as_a_solve_recipe():
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import compute, estimate_memory

    config = SolveConfig(grid=(8, 8), dim=32, heads=4, layers=2, recipe="authors-2025", offset_order="centre")
    art = compute(config, device="cpu")
    np.testing.assert_allclose(np.linalg.norm(art.q, axis=(-2, -1)), 7.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(art.k, axis=(-2, -1)), 7.0, atol=1e-5)
    assert np.abs(art.q[0] - art.q[1]).max() > 1e-2  # fresh noise per layer
    assert art.offsets[0].tolist() == art.offsets[1].tolist() == [list(o) for o in authors_offsets(4)]
    assert 0 < estimate_memory(config) < 2 ** 27


# --------------------------------------------------------------------------- what the reports say

def vit_cls(depth=2):
    """A tiny timm ViT with a class token (its position row must stay zero in 2024)."""
    m = VisionTransformer(img_size=4, patch_size=1, in_chans=1, num_classes=10, embed_dim=36, depth=depth,
                          num_heads=9, mlp_ratio=2, class_token=True, global_pool="token")
    with torch.no_grad():
        m.pos_embed.fill_(3.0)
    return m


def measured_through_the_model(model, layer, heads, offsets, prefix=1):
    """``(hit rate, target mass)`` per head of layer ``layer`` on its LayerNorm'd position embedding's
    grid rows (``prefix`` class-token rows dropped), with the model's own qkv Linear and its biases."""
    pe = model.pos_embed.detach()[0, prefix:]
    x = torch.nn.functional.layer_norm(pe, pe.shape[-1:], eps=1e-6)
    n, dim = x.shape
    d = dim // heads
    qkv = model.blocks[layer].attn.qkv(x).detach().reshape(n, 3, heads, d).permute(1, 2, 0, 3)
    attn = torch.softmax(qkv[0] @ qkv[1].transpose(-1, -2) / math.sqrt(d), dim=-1)
    cols = torch.from_numpy(target_columns(model.patch_embed.grid_size, offsets))
    has = cols >= 0
    hit = (((attn.argmax(-1) == cols) & has).sum(-1) / has.sum(-1)).tolist()
    mass = ((attn.gather(-1, cols.clamp(min=0).unsqueeze(-1)).squeeze(-1) * has).sum(-1) / has.sum(-1)).tolist()
    return hit, mass


COMMON = {"layout": "timm-vit", "grid": [4, 4], "dim": 36, "heads": 9, "padding": "zero", "causal": False,
          "not_reset": ["cls_token", "pos_embed"],
          "qk_bias": "PyTorch's default, kept (the authors' code writes the Q/K weights only)"}


def check_layers(model, report, offsets_of):
    for i, row in enumerate(report["layers"]):
        assert row["layer"] == i
        hit, mass = measured_through_the_model(model, i, 9, offsets_of(row))
        assert row["heads"]["hit_rate"] == pytest.approx(hit, abs=1e-6)
        assert row["heads"]["target_mass"] == pytest.approx(mass, abs=1e-5)
        assert row["target_mass"] == pytest.approx(np.mean(mass), abs=1e-5)
    assert report["hit_rate"] == pytest.approx(np.mean([r["hit_rate"] for r in report["layers"]]))
    assert report["target_mass"] == pytest.approx(np.mean([r["target_mass"] for r in report["layers"]]))


def test_2024_report_pe_and_cache_on_a_model_with_a_class_token(tmp_path):
    from pathlib import Path

    from structinit.geometry.embedding import sincos_2d

    cache = tmp_path / "cache"
    m = vit_cls()
    report = initialize_model(m, "impulse-2024", seed=0, recipe_params={"iters": 100}, cache_dir=cache)
    pe = m.pos_embed.detach()[0]
    assert torch.equal(pe[0], torch.zeros(36))  # the class token's row is zeroed, the grid rows are the table
    np.testing.assert_allclose(pe[1:].numpy(), sincos_2d((4, 4), 36), atol=1e-6)
    assert {k: report[k] for k in COMMON} == COMMON
    assert report["params"] == {"filter": 3, "recipe_params": {"iters": 100}}
    assert (report["recipe"], report["shared"]) == ("released", True)
    assert report["recipe_params"] == {"iters": 100, "lr": 1e-4, "norm_every": 100}
    art = report["artifact"]
    assert Path(art["path"]).parent == cache and art["key"] in Path(art["path"]).name and art["cached"] is False
    assert art["config"]["share"] is True and art["config"]["recipe"] == "released"
    assert report["pos_embed"] == {"key": "pos_embed", "written": "pos_embed[0, 1:17]", "kind": "sincos",
                                   "learnable": False}
    assert report["vproj"] == "not written (PyTorch's default from the reset)"
    assert report["measured_on"] == ("pos_embed (sin-cos), LayerNorm'd as the model's first block does, with the "
                                     "Q/K biases")
    assert [r["replaced"] for r in report["layers"]] == [
        [f"blocks.{i}.attn.qkv.weight[0:36]", f"blocks.{i}.attn.qkv.weight[36:72]"] for i in range(2)]
    assert {"patch_embed.proj (Conv2d)", "blocks.1.attn.qkv (Linear)", "norm (LayerNorm)"} <= set(report["reset"])
    check_layers(m, report, lambda row: [tuple(o) for o in row["offsets"]])
    for row in report["layers"]:  # the solve's own measure, on the pseudo input without biases
        assert set(row["solved"]) == {"hit_rate", "target_mass"} and 0 < row["solved"]["target_mass"] <= 1
    again = initialize_model(vit_cls(), "impulse-2024", seed=0, recipe_params={"iters": 100}, cache_dir=cache)
    assert again["artifact"]["cached"] is True and again["artifact"]["key"] == art["key"]


def test_2024_filter_reaches_the_solve():
    spec = init_spec("impulse-2024", filter=5)
    config = spec.impulse_spec().solve_config((8, 8), 64, 4, 4, seed=0)
    assert config.filter == 5


def test_2025_report_on_a_model_with_a_class_token():
    m = vit_cls()
    report = initialize_model(m, "impulse-2025", seed=0)
    assert {k: report[k] for k in COMMON} == COMMON
    assert report["params"] == {"filter": 3} and report["artifact"] is None
    assert (report["recipe"], report["shared"]) == ("authors-2025", False)
    assert report["recipe_params"] == recipe_params("authors-2025")
    assert report["pos_embed"] == {"key": "pos_embed", "written": "pos_embed = 18 x 0.02 x randn (seeded), every row",
                                   "std": pytest.approx(float(m.pos_embed.detach().std())), "learnable": True,
                                   "solve_layer_norm_eps": 1e-5}
    assert report["vproj"] == {"written": True, "alpha": 0.4, "beta": 0.4, "z": "uniform in +-sqrt(3/D)"}
    assert report["measured_on"] == ("pos_embed (18 x random), LayerNorm'd as the model's first block does, with "
                                     "the Q/K biases")
    check_layers(m, report, lambda row: authors_offsets(9))


@pytest.mark.parametrize("dq, dk, fails", [(2e-6, 2e-6, False), (0.5, 0.0, True), (0.0, 0.5, True)])
def test_2025_checks_what_it_reads_back(monkeypatch, dq, dk, fails):
    """Q/K read back from the model that differ from the solve (a misplaced write) are an error;
    float rounding is not."""
    import structinit.init.inject as inject

    real = inject.read_qk

    def shifted(sd, slot, heads):
        q, k = real(sd, slot, heads)
        return q + dq, k + dk

    monkeypatch.setattr(inject, "read_qk", shifted)
    if fails:
        with pytest.raises(StructinitError, match=r"^layer 0: the Q/K read back differ from the ones written; the "
                                                  r"rows were not placed as the layout expects$"):
            initialize_model(vit_cls(), "impulse-2025", seed=0)
    else:
        initialize_model(vit_cls(), "impulse-2025", seed=0)


def test_2024_checks_the_written_attention_against_the_solve(monkeypatch, tmp_path):
    import structinit.init.inject as inject

    real = inject.read_qk
    monkeypatch.setattr(inject, "read_qk", lambda sd, slot, heads: tuple(t.flip(0) for t in real(sd, slot, heads)))
    with pytest.raises(StructinitError, match=r"^layer 0: the written weights give hit_rate .* but the solve has "
                                              r".*; the Q/K rows were not placed as the layout expects$"):
        initialize_model(vit_cls(), "impulse-2024", seed=0, recipe_params={"iters": 300}, cache_dir=tmp_path)


def test_the_recipes_need_a_model_with_a_position_embedding_parameter():
    sd = vit_cls().state_dict()
    for method in ("impulse-2024", "impulse-2025"):
        with pytest.raises(UsageError) as e:
            initialize(sd, method, heads=9)
        assert says(str(e.value), method, "reset_parameters()", "needs the model", "not a state dict")
    m = vit_cls()
    pe = m.pos_embed.detach().clone()
    del m.pos_embed
    m.register_buffer("pos_embed", pe)
    with pytest.raises(UsageError) as e:
        initialize_model(m, "impulse-2025")
    assert says(str(e.value), "impulse-2025", "learnable", "pos_embed", "not an nn.Parameter")
    m.pos_embed = None
    with pytest.raises(UsageError) as e:
        initialize_model(m, "impulse-2024")
    assert "impulse-2024 writes the model's position embedding, but the model has no pos_embed tensor" in str(e.value)


def test_2025_plans_qk_and_vproj():
    from structinit.init.layouts import detect_layout

    slot = detect_layout(vit_cls().state_dict()).slots[1]
    assert init_spec("impulse-2025").planned(slot) == [
        "blocks.1.attn.qkv.weight[0:36]", "blocks.1.attn.qkv.weight[36:72]", "blocks.1.attn.qkv.bias[0:36]",
        "blocks.1.attn.qkv.bias[36:72]", "blocks.1.attn.qkv.weight[72:108]", "blocks.1.attn.proj.weight"]


@pytest.mark.parametrize("method", ["impulse-2024", "impulse-2025"])
def test_a_model_without_qk_biases_is_measured_without_them(method, tmp_path):
    m = VisionTransformer(img_size=4, patch_size=1, in_chans=1, num_classes=10, embed_dim=36, depth=1, num_heads=9,
                          mlp_ratio=2, class_token=True, global_pool="token", qkv_bias=False)
    report = initialize_model(m, method, seed=0, cache_dir=tmp_path,
                              **({"recipe_params": {"iters": 100}} if method == "impulse-2024" else {}))
    row = report["layers"][0]
    offsets = [tuple(o) for o in row["offsets"]]
    hit, mass = measured_through_the_model(m, 0, 9, offsets)
    assert row["heads"]["hit_rate"] == pytest.approx(hit, abs=1e-6)
    assert row["heads"]["target_mass"] == pytest.approx(mass, abs=1e-5)
