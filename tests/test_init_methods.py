"""Each init method alone on a real timm ViT, checked against the papers' formulas and against the
attention timm itself computes."""

import math

import numpy as np
import pytest
import torch

from structinit.analysis.quality import measure
from structinit.errors import StructinitError, UsageError
from structinit.geometry.embedding import pseudo_input, sincos_2d
from structinit.geometry.targets import impulse_columns, impulse_targets
from structinit.init.attention_target import parse_layers
from structinit.init.impulse import ImpulseInit
from structinit.init.initialize import initialize, initialize_model
from structinit.init.inject import heads_to_rows, rows_to_heads
from structinit.init.mimetic import mimetic_qk
from structinit.init.pos_embed import set_sincos_pos_embed
from structinit.init.registry import INIT_METHODS
from structinit.solver.artifact import Artifact


def impulse_config(grid, dim, heads, depth, seed=0, **params):
    return ImpulseInit(**params).solve_config(grid, dim, heads, depth, seed)

DIM, HEADS, DEPTH = 64, 4, 2


def paper_vit(heads=HEADS, depth=DEPTH, dim=DIM):
    """The paper's ViT (sin-cos PE, avg pool, no class token), small: 8x8 grid of 2x2 patches."""
    import timm

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=dim, depth=depth,
                          num_heads=heads, class_token=False, global_pool="avg", num_classes=10)
    set_sincos_pos_embed(m)
    return m


def timm_attention(model):
    """Each block's attention ``[H, N, N]`` computed by timm's own Attention on the position embedding
    alone (the non-fused path, captured at its attention dropout)."""
    maps = []
    for blk in model.blocks:
        seen = []
        blk.attn.fused_attn = False
        hook = blk.attn.attn_drop.register_forward_hook(lambda mod, inp, out, seen=seen: seen.append(out.detach()))
        with torch.no_grad():
            blk.attn(blk.norm1(model.pos_embed))
        hook.remove()
        maps.append(seen[0][0])
    return maps


def test_registry_names():
    assert list(INIT_METHODS) == ["kaiming", "trunc-normal", "mimetic", "impulse", "impulse-2024", "impulse-2025",
                                  "conditioned", "mixed"]


def test_heads_rows_round_trip_follows_spec_convention():
    q = torch.randn(3, 12, 4)
    rows = heads_to_rows(q)
    assert rows.shape == (12, 12)
    assert torch.equal(rows[4:8], q[1].T)  # rows h*d:(h+1)*d are Q_h^T
    assert torch.equal(rows_to_heads(rows, 3), q)


def test_sincos_pos_embed_is_fixed_and_matches_pseudo_input():
    m = paper_vit()
    assert not m.pos_embed.requires_grad
    assert np.array_equal(m.pos_embed[0].detach().numpy(), sincos_2d((8, 8), DIM))
    # what block 0 sees on position alone is the solver's pseudo input
    with torch.no_grad():
        seen = m.blocks[0].norm1(m.pos_embed)[0].numpy()
    np.testing.assert_allclose(seen, pseudo_input("pe", (8, 8), DIM), atol=1e-5)


def test_impulse_gives_timm_attention_the_solved_impulse_structure():
    m = paper_vit()
    rep = initialize_model(m, "impulse", data_fit=0, filter=3, target_mass=0.4)
    assert rep["hit_rate"] == 1.0 and abs(rep["target_mass"] - 0.4) < 1e-3
    for l, attn in enumerate(timm_attention(m)):
        offsets = np.array(rep["layers"][l]["offsets"])
        got = measure(pseudo_input("pe", (8, 8), DIM), *_qk_of(m, l), impulse_columns((8, 8), offsets))
        targets = torch.from_numpy(impulse_targets((8, 8), offsets))
        has = targets.sum(-1) > 0
        hits = (attn.argmax(-1) == targets.argmax(-1)) | ~has
        assert bool(hits.all()), f"layer {l}: timm's attention misses the impulse"
        mass = (attn * targets).sum(-1)[has].mean()
        assert abs(float(mass) - 0.4) < 0.01
        assert np.allclose(got.target_mass[0], rep["layers"][l]["heads"]["target_mass"], atol=1e-4)
        # the q/k biases were zeroed so the solved logits are what the model computes
        assert torch.count_nonzero(m.blocks[l].attn.qkv.bias[:2 * DIM]) == 0


def _qk_of(model, layer):
    w = model.blocks[layer].attn.qkv.weight.detach()
    return rows_to_heads(w[:DIM], HEADS), rows_to_heads(w[DIM:2 * DIM], HEADS)


def test_impulse_filter_5_softness_and_mimetic_vproj_and_pe_scale():
    m = paper_vit()
    rep = initialize_model(m, "impulse", data_fit=0, filter=5, target_mass=0.6, mimetic_vproj=True, pe_scale=3.0,
                           seed=1)
    assert max(abs(o) for row in rep["layers"] for off in row["offsets"] for o in off) <= 2
    assert abs(rep["target_mass"] - 0.6) < 1e-3
    np.testing.assert_allclose(m.pos_embed[0].detach().numpy(), 3.0 * sincos_2d((8, 8), DIM), rtol=1e-6)
    for blk in m.blocks:
        w_v = blk.attn.qkv.weight.detach()[2 * DIM:].T
        w_p = blk.attn.proj.weight.detach().T
        assert abs(float((w_v @ w_p).diagonal().mean()) + 0.4) < 0.03


def test_misplaced_rows_are_caught():
    m = paper_vit()
    rep = initialize_model(m, "impulse", data_fit=0)
    # the same weights with the heads' row blocks rotated: each head gets another head's Q
    w = m.blocks[0].attn.qkv.weight.detach()
    q, k = rows_to_heads(w[:DIM], HEADS), rows_to_heads(w[DIM:2 * DIM], HEADS)
    offsets = np.array(rep["layers"][0]["offsets"])
    x = pseudo_input("pe", (8, 8), DIM)
    right = measure(x, q, k, impulse_columns((8, 8), offsets))
    wrong = measure(x, q.transpose(-1, -2).reshape(HEADS, DIM, -1), k, impulse_columns((8, 8), offsets))
    assert right.hit_rate.mean() == 1.0 and wrong.hit_rate.mean() < 0.5
    # an artifact whose Q rows do not belong to its offsets is refused by init_impulse's read-back
    from structinit.solver.run import solve

    art = solve(impulse_config((8, 8), DIM, HEADS, DEPTH, offset_order="centre")).artifact
    assert len({tuple(o) for o in art.offsets[0]}) == HEADS  # centre first: four distinct offsets
    bad = Artifact(config=art.config, q=art.q[:, ::-1].copy(), k=art.k, offsets=art.offsets,
                   pseudo_input=art.pseudo_input, stats=art.stats)
    with pytest.raises(StructinitError, match="not placed"):
        initialize_model(paper_vit(), "impulse", data_fit=0, artifact=bad)


def test_impulse_from_artifact_and_layer_selection():
    from structinit.solver.run import solve

    art = solve(impulse_config((8, 8), DIM, HEADS, 1, seed=3)).artifact
    m = paper_vit()
    before = m.blocks[0].attn.qkv.weight.detach().clone()
    rep = initialize_model(m, "impulse", data_fit=0, artifact=art, layers=[1])
    assert [r["layer"] for r in rep["layers"]] == [1]
    assert torch.equal(m.blocks[0].attn.qkv.weight.detach(), before)
    assert rep["layers"][0]["offsets"] == art.offsets[0].tolist() and rep["hit_rate"] == 1.0
    with pytest.raises(UsageError, match="heads 2 vs 4"):
        initialize_model(m, "impulse", data_fit=0, artifact=solve(impulse_config((8, 8), DIM, 2, 1)).artifact)
    with pytest.raises(UsageError, match="out of range"):
        initialize_model(m, "impulse", data_fit=0, layers=[5])


def test_mimetic_single_head_is_the_formula_exactly():
    # heads=1: d = D, so W_Q W_K^T = a1 Z + b1 I exactly (no rank truncation)
    m = paper_vit(heads=1)
    rep = initialize_model(m, "mimetic", seed=2)
    for row, blk in zip(rep["layers"], m.blocks):
        w = blk.attn.qkv.weight.detach()
        a = w[:DIM].T @ w[DIM:2 * DIM]
        assert abs(float(a.diagonal().mean()) - 0.7) < 0.05
        off = a - torch.diag(a.diagonal())
        assert abs(float(off.std()) - 0.7 / math.sqrt(DIM)) < 0.15 * 0.7 / math.sqrt(DIM)
        vp = w[2 * DIM:].T @ blk.attn.proj.weight.detach().T  # x @ W_V @ W_proj
        assert abs(float(vp.diagonal().mean()) + 0.4) < 0.03
        z = (vp + 0.4 * torch.eye(DIM)) / 0.4
        assert abs(float(z.std()) * math.sqrt(DIM) - 1) < 0.1  # Z ~ N(0, I/D)
        assert abs(row["vproj_diag_mean"] - float(vp.diagonal().mean())) < 1e-5


def test_mimetic_multi_head_is_the_rank_d_truncation():
    gen = torch.Generator().manual_seed(0)
    q, k, a = mimetic_qk(DIM, HEADS, 0.7, 0.7, gen)
    d = DIM // HEADS
    for h in range(HEADS):
        approx = q[h] @ k[h].T
        assert torch.linalg.matrix_rank(approx) == d
        s = torch.linalg.svdvals(a[h])
        # Eckart-Young: the residual of the best rank-d fit has the tail singular values of A
        np.testing.assert_allclose(torch.linalg.svdvals(a[h] - approx)[:DIM - d].numpy(), s[d:].numpy(), atol=1e-4)
    m = paper_vit()
    rep = initialize_model(m, "mimetic")
    assert all(row["qk_diag_mean"] > 0.15 for row in rep["layers"])  # kaiming/trunc give ~0
    assert all(abs(row["vproj_diag_mean"] + 0.4) < 0.03 for row in rep["layers"])
    assert torch.count_nonzero(m.blocks[0].attn.qkv.bias[:2 * DIM]) == 0


def test_kaiming_and_trunc_normal_match_their_definitions():
    m = paper_vit()
    pe = m.pos_embed.detach().clone()
    initialize_model(m, "trunc-normal", seed=0)
    w = m.blocks[0].mlp.fc1.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.002
    assert torch.count_nonzero(m.blocks[0].attn.qkv.bias) == 0
    assert torch.equal(m.pos_embed.detach(), pe)  # the frozen sin-cos PE is not re-drawn
    initialize_model(m, "kaiming", seed=0)
    for lin in (m.blocks[0].attn.qkv, m.blocks[1].mlp.fc2):
        bound = 1 / math.sqrt(lin.weight.shape[1])  # kaiming_uniform(a=sqrt 5) = U(+-1/sqrt(fan_in))
        w = lin.weight.detach()
        assert float(w.abs().max()) <= bound and abs(float(w.std()) - bound / math.sqrt(3)) < 0.1 * bound
        assert torch.count_nonzero(lin.bias) > 0
    first = m.blocks[0].attn.qkv.weight.detach().clone()
    initialize_model(m, "kaiming", seed=0)
    assert torch.equal(first, m.blocks[0].attn.qkv.weight.detach())  # seeded


def test_state_dict_form_changes_only_qk_rows():
    sd = {k: v.clone() for k, v in paper_vit().state_dict().items()}
    ref = {k: v.clone() for k, v in sd.items()}
    rep = initialize(sd, "impulse", data_fit=0, heads=HEADS, mimetic_vproj=False)  # Q/K only
    assert rep["layout"] == "timm-vit" and rep["hit_rate"] == 1.0
    for key in sd:
        if key.endswith("attn.qkv.weight") or key.endswith("attn.qkv.bias"):
            assert torch.equal(sd[key][2 * DIM:], ref[key][2 * DIM:])  # v untouched
            assert not torch.equal(sd[key][:DIM], ref[key][:DIM]) or key.endswith("bias")
        else:
            assert torch.equal(sd[key], ref[key]), key


def test_bad_parameters():
    m = paper_vit()
    with pytest.raises(UsageError, match="no parameter"):
        initialize_model(m, "impulse", data_fit=0, filtr=3)
    with pytest.raises(UsageError, match="unknown init method"):
        initialize_model(m, "xavier")
    with pytest.raises(UsageError, match="target_mass"):
        initialize_model(m, "impulse", data_fit=0, recipe="closed-form", target_mass=0.3)
    assert parse_layers("0-1", 4) == [0, 1] and parse_layers("1,3-", 5) == [1, 3, 4]
    with pytest.raises(UsageError):
        parse_layers("2-x", 4)


@pytest.mark.parametrize("method, params", [("impulse", {"data_fit": 0}), ("mimetic", {})])
def test_each_base_resets_exactly_its_modules_and_nothing_else(method, params):
    """Issue 45, behaviour 6: ``base`` resets, before the init writes its part, exactly the modules it
    names, to PyTorch's defaults under the seed: ``pytorch-mlp`` both Linear layers (fc1 and fc2) of
    every block's MLP, ``pytorch-head`` the classifier, ``pytorch`` every module with
    ``reset_parameters`` (of which the init then writes Q/K, V and proj weights again). Measured as
    the tensors that differ from the same init on the model as built (``base=model``)."""
    from conftest import vit_digits

    def init(base):
        model = vit_digits(pool="token")
        rep = initialize_model(model, method, base=base, seed=0, **params)
        return model, rep

    built, rep = init("model")
    assert "base_reset" not in rep
    mlp = {f"blocks.{i}.mlp.fc{j}.{w}" for i in range(4) for j in (1, 2) for w in ("weight", "bias")}
    head = {"head.weight", "head.bias"}
    # every weight of PyTorch's defaults that the init does not write again; LayerNorm's defaults (ones, zeros)
    # and the patch embedding's are the model's own as built, so they do not differ
    biases = {f"blocks.{i}.attn.{p}.bias" for i in range(4) for p in ("qkv", "proj")}
    resettable = sum(callable(getattr(m, "reset_parameters", None)) for m in built.modules())
    for base, want, count in (("pytorch-mlp", mlp, 8), ("pytorch-head", head, 1),
                              ("pytorch", mlp | head | biases, resettable)):
        model, rep = init(base)
        changed = {name for (name, a), (_, b) in zip(model.state_dict().items(), built.state_dict().items())
                   if not torch.equal(a, b)}
        assert changed == want, (base, sorted(changed ^ want))
        assert rep["base_reset"] == count, base
    model, _ = init("pytorch-mlp")
    torch.manual_seed(0)
    first = torch.nn.Linear(64, 128)  # the first module reset, under the seed: PyTorch's own default draw
    assert torch.equal(model.blocks[0].mlp.fc1.weight, first.weight)
    assert torch.equal(model.blocks[0].mlp.fc1.bias, first.bias)
