"""What the init entry points write, layer by layer: layer ``l`` gets the artifact's layer ``l``
(not just "a solution"), the same through a model, a state dict of each layout, and a checkpoint
file; every other tensor is left alone; mimetic and the baselines draw what they document."""

import math

import numpy as np
import pytest
import torch
from conftest import says

from structinit.apply.checkpoint import apply_checkpoint
from structinit.errors import StructinitError, UsageError
from structinit.geometry.embedding import sincos
from structinit.init.attention_target import AttentionTarget
from structinit.init.initialize import initialize, initialize_model
from structinit.init.inject import heads_to_rows, label, read_qk, read_vproj, rows_to_heads, write_qk, write_vproj
from structinit.init.layouts import Part, detect_layout
from structinit.init.mimetic import mimetic_qk, mimetic_v_proj
from structinit.init.pos_embed import pe_kind, set_sincos_pos_embed, write_sincos
from structinit.solver.artifact import read_artifact
from structinit.solver.config import SolveConfig
from structinit.solver.run import solve

DIM, HEADS, DEPTH, GRID = 32, 4, 3, (4, 4)


def tiny_vit(depth=DEPTH, class_token=False, seed=0):
    import timm

    torch.manual_seed(seed)
    m = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=DIM, depth=depth,
                          num_heads=HEADS, mlp_ratio=2.0, class_token=class_token,
                          global_pool="token" if class_token else "avg", num_classes=3)
    set_sincos_pos_embed(m)
    return m


def hf_state_dict(depth=DEPTH, seed=0):
    """A Hugging Face ViT state dict (the names transformers writes), built without transformers."""
    g = torch.Generator().manual_seed(seed)
    sd = {"embeddings.cls_token": torch.randn(1, 1, DIM, generator=g),
          "embeddings.position_embeddings": torch.randn(1, 1 + 16, DIM, generator=g),
          "embeddings.patch_embeddings.projection.weight": torch.randn(DIM, 3, 2, 2, generator=g)}
    for i in range(depth):
        for p in ("query", "key", "value"):
            sd[f"encoder.layer.{i}.attention.attention.{p}.weight"] = torch.randn(DIM, DIM, generator=g)
            sd[f"encoder.layer.{i}.attention.attention.{p}.bias"] = torch.randn(DIM, generator=g)
        sd[f"encoder.layer.{i}.attention.output.dense.weight"] = torch.randn(DIM, DIM, generator=g)
        sd[f"encoder.layer.{i}.attention.output.dense.bias"] = torch.randn(DIM, generator=g)
    write_sincos(sd["embeddings.position_embeddings"], (4, 4))  # the table the impulse solve assumes
    return sd


@pytest.fixture(scope="module")
def art3(tmp_path_factory):
    """A three-layer artifact, every layer its own solve and offsets."""
    cfg = SolveConfig(grid=GRID, dim=DIM, heads=HEADS, layers=DEPTH, seed=5)
    art = solve(cfg, cache_dir=tmp_path_factory.mktemp("art3")).artifact
    assert len({art.q[l].tobytes() for l in range(DEPTH)}) == DEPTH
    return art


def timm_qk(sd, layer, prefix=""):
    w = sd[f"{prefix}blocks.{layer}.attn.qkv.weight"].detach().float()
    return rows_to_heads(w[:DIM], HEADS), rows_to_heads(w[DIM:2 * DIM], HEADS)


def hf_qk(sd, layer):
    base = f"encoder.layer.{layer}.attention.attention."
    return (rows_to_heads(sd[base + "query.weight"].float(), HEADS),
            rows_to_heads(sd[base + "key.weight"].float(), HEADS))


def assert_layer_is(q, k, art, src):
    assert torch.equal(q, torch.from_numpy(art.q[src])), f"q is not the artifact's layer {src}"
    assert torch.equal(k, torch.from_numpy(art.k[src])), f"k is not the artifact's layer {src}"


def assert_report_matches(report_rows, art):
    for row in report_rows:
        src = row["layer"] if art.config.layers > 1 else 0
        assert row["offsets"] == art.offsets[src].tolist()
        layer_stats = art.stats["layers"][src]
        for m in ("hit_rate", "target_mass", "mse"):
            want = [h[m] for h in layer_stats]
            np.testing.assert_allclose(row["heads"][m], want, rtol=1e-4, atol=1e-6)
            assert row[m] == pytest.approx(float(np.mean(want)), rel=1e-4, abs=1e-6)


def test_model_layer_l_gets_artifact_layer_l(art3):
    m = tiny_vit()
    rep = initialize_model(m, "impulse", data_fit=0, artifact=art3)
    sd = m.state_dict()
    for l in range(DEPTH):
        assert_layer_is(*timm_qk(sd, l), art3, l)
        assert torch.count_nonzero(m.blocks[l].attn.qkv.bias[:2 * DIM]) == 0
    assert [r["layer"] for r in rep["layers"]] == [0, 1, 2]
    assert_report_matches(rep["layers"], art3)
    assert rep["hit_rate"] == pytest.approx(np.mean([r["hit_rate"] for r in rep["layers"]]))
    assert rep["target_mass"] == pytest.approx(np.mean([r["target_mass"] for r in rep["layers"]]))
    assert rep["artifact"]["key"] == art3.key and rep["artifact"]["cached"] is None
    assert rep["artifact"]["path"] == str(art3.path) and rep["artifact"]["config"] == art3.config.to_dict()
    assert (rep["grid"], rep["dim"], rep["heads"], rep["layout"]) == ([4, 4], DIM, HEADS, "timm-vit")


def test_state_dict_and_model_entry_points_write_the_same_rows(art3):
    m = tiny_vit()
    sd = {k: v.clone() for k, v in tiny_vit().state_dict().items()}
    before = {k: v.clone() for k, v in sd.items()}
    initialize_model(m, "impulse", artifact=art3, layers=[2, 0], mimetic_vproj=False, data_fit=0)
    rep = initialize(sd, "impulse", data_fit=0, artifact=art3, heads=HEADS, layers=[2, 0], mimetic_vproj=False)
    assert [r["layer"] for r in rep["layers"]] == [0, 2]
    msd = m.state_dict()
    for l in (0, 2):
        assert_layer_is(*timm_qk(sd, l), art3, l)
        assert torch.equal(sd[f"blocks.{l}.attn.qkv.weight"], msd[f"blocks.{l}.attn.qkv.weight"])
    for key in sd:  # layer 1 and everything else untouched; v rows untouched
        if key.startswith(("blocks.0.attn.qkv", "blocks.2.attn.qkv")):
            assert torch.equal(sd[key][2 * DIM:], before[key][2 * DIM:]), key
        else:
            assert torch.equal(sd[key], before[key]), key
    assert_report_matches(rep["layers"], art3)


def test_hugging_face_layout_layer_l_gets_layer_l(art3):
    sd = hf_state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    rep = initialize(sd, "impulse", data_fit=0, artifact=art3, heads=HEADS, mimetic_vproj=False)
    assert rep["layout"] == "hf-vit"
    for l in range(DEPTH):
        assert_layer_is(*hf_qk(sd, l), art3, l)
        base = f"encoder.layer.{l}.attention.attention."
        assert torch.count_nonzero(sd[base + "query.bias"]) == 0 and torch.count_nonzero(sd[base + "key.bias"]) == 0
        assert torch.equal(sd[base + "value.weight"], before[base + "value.weight"])
        assert torch.equal(sd[base + "value.bias"], before[base + "value.bias"])
    assert_report_matches(rep["layers"], art3)
    base = "encoder.layer.1.attention.attention."
    assert rep["layers"][1]["replaced"] == [base + "query.weight[0:32]", base + "key.weight[0:32]",
                                            base + "query.bias[0:32]", base + "key.bias[0:32]"]


def test_a_one_layer_artifact_is_every_layers_source(tmp_path):
    art = solve(SolveConfig(grid=GRID, dim=DIM, heads=HEADS, seed=2), cache_dir=tmp_path).artifact
    m = tiny_vit()
    rep = initialize_model(m, "impulse", data_fit=0, artifact=art.path)
    for l in range(DEPTH):
        assert_layer_is(*timm_qk(m.state_dict(), l), art, 0)
    assert_report_matches(rep["layers"], art)
    assert rep["artifact"]["path"] == str(art.path)
    rep = initialize_model(tiny_vit(), "impulse", data_fit=0, artifact=art.key,
                           cache_dir=tmp_path)  # a key in the cache
    assert rep["artifact"]["key"] == art.key


def test_solved_on_the_fly_each_layer_gets_its_own_solve(cache_dir):
    m = tiny_vit()
    rep = initialize_model(m, "impulse", data_fit=0, seed=7, filter=3, target_mass=0.45)
    art = read_artifact(rep["artifact"]["path"])
    assert rep["artifact"]["cached"] is False and art.config.layers == DEPTH and art.config.seed == 7
    assert art.config.params["target_mass"] == 0.45 and art.path.parent == cache_dir
    for l in range(DEPTH):
        assert_layer_is(*timm_qk(m.state_dict(), l), art, l)
    again = initialize_model(tiny_vit(), "impulse", data_fit=0, seed=7, filter=3, target_mass=0.45)
    assert again["artifact"]["cached"] is True and again["artifact"]["key"] == art.key
    shared = initialize_model(tiny_vit(), "impulse", data_fit=0, seed=7, share=True)
    assert read_artifact(shared["artifact"]["path"]).config.share is True
    assert len({str(r["offsets"]) for r in shared["layers"]}) == 1


def test_checkpoint_file_layer_l_gets_layer_l_in_every_copy(art3, tmp_path):
    sd = tiny_vit().state_dict()
    ema = {k: v.clone() * 0.5 for k, v in sd.items()}
    src = tmp_path / "train.pth"
    torch.save({"state_dict": sd, "state_dict_ema": ema, "epoch": 3}, src)
    rep = apply_checkpoint(src, data_fit=0, artifact=art3.path, heads=HEADS, layers="2,0")
    assert [r["layer"] for r in rep["layers"]] == [0, 2]
    new = torch.load(rep["output"], weights_only=True)
    for name in ("state_dict", "state_dict_ema"):
        for l in (0, 2):
            assert_layer_is(*timm_qk(new[name], l), art3, l)
        assert torch.equal(new[name]["blocks.1.attn.qkv.weight"], (sd if name == "state_dict" else ema)[
            "blocks.1.attn.qkv.weight"])
    assert_report_matches(rep["layers"], art3)
    assert rep["artifact"]["key"] == art3.key and new["epoch"] == 3


def test_impulse_with_mimetic_vproj_on_a_state_dict_matches_the_model(art3):
    m = tiny_vit()
    sd = {k: v.clone() for k, v in tiny_vit().state_dict().items()}
    initialize_model(m, "impulse", data_fit=0, artifact=art3, mimetic_vproj=True, alpha2=0.3, beta2=0.5, seed=4)
    rep = initialize(sd, "impulse", data_fit=0, artifact=art3, mimetic_vproj=True, alpha2=0.3, beta2=0.5, seed=4,
                     heads=HEADS)
    msd = m.state_dict()
    gen = torch.Generator().manual_seed(5)  # impulse draws V/proj from seed + 1
    for l in range(DEPTH):
        for key in (f"blocks.{l}.attn.qkv.weight", f"blocks.{l}.attn.proj.weight"):
            assert torch.equal(sd[key], msd[key]), key
        w_v, w_p, _ = mimetic_v_proj(DIM, 0.3, 0.5, gen)
        assert torch.allclose(sd[f"blocks.{l}.attn.qkv.weight"][2 * DIM:], w_v.T)
        assert torch.allclose(sd[f"blocks.{l}.attn.proj.weight"], w_p.T)
        vp = sd[f"blocks.{l}.attn.qkv.weight"][2 * DIM:].T @ sd[f"blocks.{l}.attn.proj.weight"].T
        assert abs(float(vp.diagonal().mean()) + 0.5) < 0.05
        assert rep["layers"][l]["replaced"][-2:] == [f"blocks.{l}.attn.qkv.weight[64:96]",
                                                     f"blocks.{l}.attn.proj.weight"]
    assert rep["mimetic_vproj"] is True and rep["pe_scale"] is None


def test_pe_scale_reaches_a_model_and_is_refused_for_a_state_dict(art3):
    m = tiny_vit()
    rep = initialize_model(m, "impulse", data_fit=0, artifact=art3, pe_scale=2.5)
    assert rep["pe_scale"] == 2.5 and not m.pos_embed.requires_grad
    assert torch.allclose(m.pos_embed[0], 2.5 * torch.from_numpy(sincos(GRID, DIM)))
    with pytest.raises(UsageError, match="pe_scale needs a model"):
        initialize(tiny_vit().state_dict(), "impulse", data_fit=0, artifact=art3, pe_scale=2.0, heads=HEADS)


def test_a_misplaced_layer_is_caught_on_every_layer(art3):
    """Weights whose layer l holds another layer's solve are refused by the read-back."""
    from dataclasses import replace

    swapped = replace(art3, q=art3.q[[1, 0, 2]].copy(), k=art3.k[[1, 0, 2]].copy(), path=None)
    with pytest.raises(StructinitError, match="layer 0: the written weights give hit_rate"):
        initialize_model(tiny_vit(), "impulse", data_fit=0, artifact=swapped)
    with pytest.raises(StructinitError, match="layer 0: the written weights give"):
        initialize(hf_state_dict(), "impulse", data_fit=0, artifact=swapped,
                   heads=HEADS)  # the state-dict path checks too


def test_artifact_that_does_not_fit_is_refused(art3, tmp_path):
    two = solve(SolveConfig(grid=GRID, dim=DIM, heads=HEADS, layers=2), cache_dir=tmp_path).artifact
    with pytest.raises(UsageError, match="has 2 layers but layer 2 was asked for"):
        initialize_model(tiny_vit(), "impulse", data_fit=0, artifact=two)
    initialize_model(tiny_vit(), "impulse", data_fit=0, artifact=two, layers=[0, 1])  # fits the layers asked for
    other = solve(SolveConfig(grid=(4, 8), dim=DIM, heads=2), cache_dir=tmp_path).artifact
    with pytest.raises(UsageError) as err:
        initialize_model(tiny_vit(), "impulse", data_fit=0, artifact=other)
    assert says(str(err.value), "does not fit the model", "heads 2 vs 4", "grid 4x8 vs 4x4")


# --------------------------------------------------------------------------- mimetic and baselines

@pytest.mark.parametrize("vproj", [True, False])
def test_mimetic_writes_one_fresh_draw_per_layer_in_order(vproj):
    m = tiny_vit()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    rep = initialize_model(m, "mimetic", seed=3, alpha1=0.5, beta1=0.9, alpha2=0.2, beta2=0.6, vproj=vproj)
    gen = torch.Generator().manual_seed(3)
    sd = m.state_dict()
    for l in range(DEPTH):
        q, k, _ = mimetic_qk(DIM, HEADS, 0.5, 0.9, gen)
        rq, rk = timm_qk(sd, l)
        assert torch.equal(rq, q) and torch.equal(rk, k)
        assert torch.count_nonzero(sd[f"blocks.{l}.attn.qkv.bias"][:2 * DIM]) == 0
        row = rep["layers"][l]
        assert row["qk_diag_mean"] == pytest.approx(float((q @ k.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).mean()),
                                                    rel=1e-5)
        if vproj:
            w_v, w_p, _ = mimetic_v_proj(DIM, 0.2, 0.6, gen)
            assert torch.allclose(sd[f"blocks.{l}.attn.qkv.weight"][2 * DIM:].T, w_v)
            assert row["vproj_diag_mean"] == pytest.approx(float((w_v @ w_p).diagonal().mean()), rel=1e-5)
            assert row["replaced"] == [f"blocks.{l}.attn.qkv.weight[0:32]", f"blocks.{l}.attn.qkv.weight[32:64]",
                                       f"blocks.{l}.attn.qkv.bias[0:32]", f"blocks.{l}.attn.qkv.bias[32:64]",
                                       f"blocks.{l}.attn.qkv.weight[64:96]", f"blocks.{l}.attn.proj.weight"]
        else:
            assert "vproj_diag_mean" not in row
            v_rows = f"blocks.{l}.attn.qkv.weight"
            assert torch.equal(sd[v_rows][2 * DIM:], before[v_rows][2 * DIM:])
            assert torch.equal(sd[f"blocks.{l}.attn.proj.weight"], before[f"blocks.{l}.attn.proj.weight"])
    for l in range(DEPTH):  # Q/K biases zeroed, V and proj biases kept
        assert torch.equal(sd[f"blocks.{l}.attn.qkv.bias"][2 * DIM:], before[f"blocks.{l}.attn.qkv.bias"][2 * DIM:])
        assert torch.equal(sd[f"blocks.{l}.attn.proj.bias"], before[f"blocks.{l}.attn.proj.bias"])
    assert not torch.equal(timm_qk(sd, 0)[0], timm_qk(sd, 1)[0])
    assert rep["params"] == {"alpha1": 0.5, "beta1": 0.9, "alpha2": 0.2, "beta2": 0.6, "vproj": vproj, "base": "model"}
    assert (rep["method"], rep["dim"], rep["heads"], rep["layout"]) == ("mimetic", DIM, HEADS, "timm-vit")


def test_mimetic_factors_have_the_documented_shapes_and_products():
    gen = torch.Generator().manual_seed(0)
    q, k, a = mimetic_qk(DIM, HEADS, 0.7, 0.3, gen)
    d = DIM // HEADS
    assert q.shape == k.shape == (HEADS, DIM, d) and a.shape == (HEADS, DIM, DIM)
    assert q.dtype == k.dtype == a.dtype == torch.float32
    z = (a - 0.3 * torch.eye(DIM)) / 0.7  # Z ~ N(0, I/D), fresh per head
    assert abs(float(z.std()) * math.sqrt(DIM) - 1) < 0.1
    assert not torch.allclose(z[0], z[1])
    w_v, w_p, av = mimetic_v_proj(DIM, 0.4, 0.2, gen)
    assert torch.allclose(w_v @ w_p, av, atol=1e-5)  # full rank: the product is A exactly
    zv = (av + 0.2 * torch.eye(DIM)) / 0.4
    assert abs(float(zv.std()) * math.sqrt(DIM) - 1) < 0.1 and abs(float(zv.diagonal().mean())) < 0.2


def test_baselines_on_a_state_dict_redraw_only_qk_rows():
    for method, check in (("kaiming", "uniform"), ("trunc-normal", "normal")):
        sd = {k: v.clone() for k, v in tiny_vit().state_dict().items()}
        before = {k: v.clone() for k, v in sd.items()}
        params = {"std": 0.05} if method == "trunc-normal" else {}
        rep = initialize(sd, method, heads=HEADS, layers=[0, 2], seed=1, **params)
        assert rep["method"] == method and rep["layout"] == "timm-vit"
        assert [r["layer"] for r in rep["layers"]] == [0, 2]
        assert rep["layers"][0]["replaced"] == ["blocks.0.attn.qkv.weight[0:32]", "blocks.0.attn.qkv.bias[0:32]",
                                                "blocks.0.attn.qkv.weight[32:64]", "blocks.0.attn.qkv.bias[32:64]"]
        bound = 1 / math.sqrt(DIM)
        for l in (0, 2):
            w = sd[f"blocks.{l}.attn.qkv.weight"]
            b = sd[f"blocks.{l}.attn.qkv.bias"]
            q, k = w[:DIM], w[DIM:2 * DIM]
            assert not torch.equal(q, k)
            assert len(torch.unique(q)) == DIM * DIM  # every entry its own draw (no repeated rows)
            if check == "uniform":
                assert float(w[:2 * DIM].abs().max()) <= bound
                assert abs(float(q.std()) - bound / math.sqrt(3)) < 0.15 * bound
                qb = b[:2 * DIM]
                assert float(qb.abs().max()) <= bound and torch.count_nonzero(qb) == 2 * DIM
                assert float(qb.min()) < -bound / 4 and float(qb.max()) > bound / 4  # U(-bound, bound)
                assert abs(float(qb.std()) - bound / math.sqrt(3)) < 0.3 * bound
            else:
                assert abs(float(w[:2 * DIM].std()) - 0.05) < 0.005
                assert torch.count_nonzero(b[:2 * DIM]) == 0
            assert torch.equal(w[2 * DIM:], before[f"blocks.{l}.attn.qkv.weight"][2 * DIM:])
            assert torch.equal(b[2 * DIM:], before[f"blocks.{l}.attn.qkv.bias"][2 * DIM:])
        assert not torch.equal(sd["blocks.0.attn.qkv.weight"][:DIM], sd["blocks.2.attn.qkv.weight"][:DIM])
        assert torch.equal(sd["blocks.1.attn.qkv.weight"], before["blocks.1.attn.qkv.weight"])
        again = {k: v.clone() for k, v in before.items()}
        initialize(again, method, heads=HEADS, layers=[0, 2], seed=1, **params)
        for key in ("blocks.2.attn.qkv.weight", "blocks.2.attn.qkv.bias"):
            assert torch.equal(again[key], sd[key])  # seeded, biases included
        other = {k: v.clone() for k, v in before.items()}
        initialize(other, method, heads=HEADS, layers=[0, 2], seed=2, **params)
        assert not torch.equal(other["blocks.2.attn.qkv.weight"], sd["blocks.2.attn.qkv.weight"])


def test_trunc_normal_on_a_state_dict_truncates_at_two():
    sd = {k: v.clone() for k, v in tiny_vit(depth=1).state_dict().items()}
    initialize(sd, "trunc-normal", heads=HEADS, std=1.5, seed=0)
    q = sd["blocks.0.attn.qkv.weight"][:2 * DIM]
    assert float(q.max()) == 2.0 and float(q.min()) == -2.0  # timm's trunc_normal_ bounds, a=-2, b=2
    assert abs(float(q.std()) - 1.2) < 0.15  # std 1.5 cut at +-2


def test_baselines_on_a_model_reset_what_they_document():
    m = tiny_vit()
    n_linear = sum(isinstance(x, torch.nn.Linear) for x in m.modules())
    n_conv = sum(isinstance(x, (torch.nn.Conv2d, torch.nn.Conv1d)) for x in m.modules())
    rep = initialize_model(m, "kaiming", seed=0).to_dict()
    changed = rep.pop("changed")  # every weight of a Linear or Conv, read from the tensors
    assert rep == {"method": "kaiming", "modules_reset": n_linear + n_conv}
    # every Linear is redrawn (the patch embedding's Conv2d is drawn as the model was built, from the same seed)
    weights = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    assert {f"{n}.weight" for n in weights} <= set(changed) and "pos_embed" not in changed
    assert pe_kind(m.pos_embed, GRID) == "sincos"  # not a module: kept
    learned = tiny_vit()
    learned.pos_embed.requires_grad_(True)
    rep = initialize_model(learned, "trunc-normal", std=0.03, seed=0).to_dict()
    assert "pos_embed" in rep.pop("changed")
    assert rep == {"method": "trunc-normal", "std": 0.03, "linear_reset": n_linear}
    assert abs(float(learned.pos_embed.detach().std()) - 0.03) < 0.005  # a learnable PE is redrawn
    assert abs(float(learned.blocks[1].mlp.fc1.weight.detach().std()) - 0.03) < 0.003
    cls = tiny_vit(class_token=True)
    with torch.no_grad():
        cls.cls_token.fill_(1.0)
        for mod in cls.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.bias.fill_(1.0)
    initialize_model(cls, "trunc-normal", seed=0)
    assert 0 < float(cls.cls_token.detach().abs().max()) < 1e-5  # normal, std 1e-6
    assert all(torch.count_nonzero(mod.bias) == 0 for mod in cls.modules() if isinstance(mod, torch.nn.Linear))
    assert pe_kind(cls.pos_embed, GRID) == "sincos"  # frozen: kept


def test_methods_that_need_no_grid_work_on_any_attention_module():
    """nn.MultiheadAttention has no patch grid: mimetic and the baselines do not need one."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(DIM, HEADS)
    before = mha.in_proj_weight.detach().clone()
    rep = initialize(mha, "mimetic", heads=HEADS, seed=1)
    assert rep["layout"] == "torch-mha" and rep["layers"][0]["replaced"] == [
        "in_proj_weight[0:32]", "in_proj_weight[32:64]", "in_proj_bias[0:32]", "in_proj_bias[32:64]",
        "in_proj_weight[64:96]", "out_proj.weight"]
    assert not torch.equal(mha.in_proj_weight.detach()[:DIM], before[:DIM])
    assert initialize(mha, "trunc-normal", heads=HEADS) == {"method": "trunc-normal", "std": 0.02, "linear_reset": 1,
                                                            "changed": ["out_proj.weight"]}  # its one Linear
    assert torch.count_nonzero(mha.out_proj.bias) == 0
    assert initialize(mha, "kaiming", heads=HEADS)["modules_reset"] == 1
    with pytest.raises(UsageError, match="no patch_embed.grid_size; pass grid"):
        initialize(mha, "impulse", data_fit=0, heads=HEADS)  # impulse does


# --------------------------------------------------------------------------- inject and pos_embed helpers

def test_write_qk_touches_only_its_rows_and_reads_back():
    sd = {k: v.clone() for k, v in tiny_vit(depth=1).state_dict().items()}
    slot = detect_layout(sd).slots[0]
    q, k = torch.randn(HEADS, DIM, DIM // HEADS), torch.randn(HEADS, DIM, DIM // HEADS)
    bias = sd["blocks.0.attn.qkv.bias"].clone()
    keys = write_qk(sd, slot, q, k, zero_bias=False)
    assert keys == ["blocks.0.attn.qkv.weight[0:32]", "blocks.0.attn.qkv.weight[32:64]"]
    assert torch.equal(sd["blocks.0.attn.qkv.bias"], bias)
    rq, rk = read_qk(sd, slot, HEADS)
    assert torch.equal(rq, q) and torch.equal(rk, k)
    rq.zero_()  # a copy: the state dict keeps its rows
    assert torch.equal(heads_to_rows(q), sd["blocks.0.attn.qkv.weight"][:DIM])
    w_v, w_p = torch.randn(DIM, DIM), torch.randn(DIM, DIM)
    assert write_vproj(sd, slot, w_v, w_p) == ["blocks.0.attn.qkv.weight[64:96]", "blocks.0.attn.proj.weight"]
    rv, rp = read_vproj(sd, slot)
    assert torch.equal(rv, w_v) and torch.equal(rp, w_p)
    assert label(Part("a.b", 3, 7)) == "a.b[3:7]"
    half = {k: v.half() for k, v in sd.items()}
    write_qk(half, slot, q, k)
    assert half["blocks.0.attn.qkv.weight"].dtype == torch.float16
    assert torch.count_nonzero(half["blocks.0.attn.qkv.bias"][:2 * DIM]) == 0


def test_write_vproj_without_an_output_projection_is_an_error():
    from dataclasses import replace

    sd = tiny_vit(depth=1).state_dict()
    slot = replace(detect_layout(sd).slots[0], proj=None)
    with pytest.raises(StructinitError, match="layer 0: no output projection found"):
        write_vproj(sd, slot, torch.eye(DIM), torch.eye(DIM))
    assert read_vproj(sd, slot)[1] is None


def test_write_sincos_on_model_and_state_dict_alike(tmp_path):
    m = tiny_vit(class_token=True)
    with torch.no_grad():
        m.pos_embed.fill_(5.0)
    assert set_sincos_pos_embed(m, scale=2.0, zero_prefix=True) == "pos_embed[0, 1:17]"
    table = torch.from_numpy(sincos(GRID, DIM))
    assert torch.allclose(m.pos_embed[0, 1:], 2.0 * table) and torch.count_nonzero(m.pos_embed[0, 0]) == 0
    assert not m.pos_embed.requires_grad and pe_kind(m.pos_embed, GRID) == "sincos x2"
    sd = {k: v.clone() for k, v in tiny_vit(class_token=True).state_dict().items()}
    sd["pos_embed"].fill_(5.0)
    src = tmp_path / "vit.pt"
    torch.save(sd, src)
    rep = apply_checkpoint(src, "mimetic", heads=HEADS, set_pe="sincos", pe_scale=2.0)
    new = torch.load(rep["output"], weights_only=True)["pos_embed"]
    assert torch.allclose(new[0, 1:], 2.0 * table) and torch.equal(new[0, 0], torch.full((DIM,), 5.0))
    assert rep["pos_embed_replaced"] == "pos_embed" and rep["pe_scale"] == 2.0 and rep["set_pe"] == "sincos"
    assert pe_kind(new, GRID) == "sincos x2" and pe_kind(new[0, 1:], GRID) == "sincos x2"
    assert pe_kind(torch.from_numpy(sincos(GRID, DIM)), GRID) == "sincos"
    assert pe_kind(-torch.from_numpy(sincos(GRID, DIM)), GRID) == "other"
    assert pe_kind(torch.randn(17, DIM), GRID) == "other"
    half = torch.zeros(1, 17, DIM, dtype=torch.float16)
    assert write_sincos(half, GRID, scale=3.0, name="pe") == "pe[0, 1:17]"
    assert half.dtype == torch.float16 and torch.allclose(half[0, 1:].float(), 3.0 * table, atol=2e-3)
    assert torch.count_nonzero(half[0, 0]) == 0
    with pytest.raises(UsageError, match="pe_scale must be finite"):
        write_sincos(torch.zeros(1, 16, DIM), GRID, scale=float("inf"))
    with pytest.raises(UsageError) as err:
        write_sincos(torch.zeros(1, 15, DIM), GRID)
    assert says(str(err.value), "pos_embed", "[1, 15, 32]", "4x4 grid")
    with pytest.raises(UsageError, match="cannot hold"):
        write_sincos(torch.zeros(16, DIM), GRID)
    with pytest.raises(UsageError, match="has no pos_embed tensor"):
        set_sincos_pos_embed(torch.nn.Linear(2, 2), GRID)


def test_attention_target_shape_and_layer_selection():
    m = tiny_vit()
    t = AttentionTarget(m, layers="1-")
    assert (t.grid, t.heads, t.dim, t.depth, t.layers, t.layout) == ((4, 4), HEADS, DIM, DEPTH, [1, 2], "timm-vit")
    assert [s.index for s in t.slots] == [1, 2]
    assert AttentionTarget(m, layers=[2, 0, 2]).layers == [0, 2]
    assert AttentionTarget(m.state_dict(), heads=2, need_grid=False).grid == (4, 4)  # from the pos_embed
    with pytest.raises(UsageError, match="no layers selected"):
        AttentionTarget(m, layers=[])
    with pytest.raises(UsageError) as err:
        AttentionTarget(m, layers="3")
    assert says(str(err.value), "layers [3]", "out of range", "3 attention layers", "0..2")
    with pytest.raises(StructinitError, match=r"no attention layers found; keys seen: k0, k1, .*k11 \.\.\.$"):
        AttentionTarget({f"k{i}": torch.zeros(1) for i in range(13)})
    with pytest.raises(StructinitError, match=r"keys seen: a$"):
        AttentionTarget({"a": torch.zeros(1)})
    with pytest.raises(UsageError, match="no patch_embed.grid_size; pass grid"):
        initialize_model(torch.nn.Linear(2, 2), "impulse")
    with pytest.raises(UsageError, match="needs an nn.Module"):
        initialize_model(m.state_dict(), "mimetic")


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_no_file(tmp_path):
    """A full disk (a file-size limit standing in) while writing the output: a CheckpointError
    naming the cause, the input untouched, and no output or temp file."""
    import resource
    import signal

    from structinit.init.checkpoints import CheckpointError

    src = tmp_path / "vit.pt"
    torch.save(tiny_vit().state_dict(), src)
    before = src.read_bytes()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        # torch.save reports a failure inside a record as an OSError and one at a record's end as a
        # RuntimeError (after the OSError): limits across the file meet both
        for limit in range(1000, 6000, 500):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            with pytest.raises(CheckpointError, match=r"vit\.mimetic\.pt: cannot write \(File too large\)"):
                apply_checkpoint(src, "mimetic", heads=HEADS)
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["vit.pt"]


def test_seeded_draws_are_the_same_across_versions():
    """Golden values: a run's key assumes an init depends only on its settings, so the numbers a
    seed draws must not drift between versions (mimetic in float64, then float32)."""
    gen = torch.Generator().manual_seed(0)
    q, k, a = mimetic_qk(8, 2, 0.7, 0.7, gen)
    w_v, w_p, av = mimetic_v_proj(8, 0.4, 0.4, gen)
    got = [float(a[0, 0, 0]), float(a[1, 2, 3]), float(q[0].abs().sum()), float(av[0, 1]), float(w_v.abs().sum())]
    assert got == pytest.approx([0.1282022446, 0.0975414589, 10.00126457, 0.0018989356, 13.16102791], rel=1e-5)


@pytest.mark.parametrize("spec, want", [
    (None, [0, 1, 2, 3]), ("all", [0, 1, 2, 3]), (" all ", [0, 1, 2, 3]), ("2", [2]), ("2-2", [2]),
    ("2-", [2, 3]), ("3,0-1", [0, 1, 3]), (" 1 , 1 ", [1]), ("0-3", [0, 1, 2, 3]),
])
def test_layer_specs(spec, want):
    from structinit.init.attention_target import parse_layers

    assert parse_layers(spec, 4) == want


@pytest.mark.parametrize("spec", ["3-1", "x", "", "1,,2", "1-2-3", "one"])
def test_bad_layer_specs_name_the_parameter(spec):
    from structinit.init.attention_target import parse_layers

    with pytest.raises(UsageError) as exc:
        parse_layers(spec, 4)
    assert says(exc.value.render(lambda n: f"<{n}>"), "<layers>", "'all'", "0-based indices", f"got {spec!r}")


@pytest.mark.parametrize("spec, depth", [("-1", 4), ("0, -2", 12), (" -0", 1)])
def test_negative_layer_indices_are_refused_with_the_range_there_is(spec, depth):
    from structinit.init.attention_target import parse_layers

    with pytest.raises(UsageError) as exc:
        parse_layers(spec, depth)
    part = spec.split(",")[-1].strip()
    assert says(exc.value.render(lambda n: f"<{n}>"), "<layers>", "not negative", repr(part), f"0..{depth - 1}", "'N-'")


def test_shape_hints_and_their_refusals():
    from structinit.init.family import model_heads

    with pytest.raises(UsageError) as exc:
        model_heads(torch.nn.Linear(2, 2))
    assert says(exc.value.render(lambda n: f"<{n}>"), "blocks[0].attn.num_heads", "pass <heads>")
    mha = torch.nn.MultiheadAttention(DIM, HEADS).state_dict()
    with pytest.raises(UsageError, match="grid"):
        AttentionTarget(mha, heads=HEADS)  # the grid is needed unless a method says otherwise
    assert AttentionTarget(mha, heads=HEADS, need_grid=False).grid is None
    with pytest.raises(StructinitError) as exc:
        AttentionTarget({f"k{i}": torch.zeros(1) for i in range(12)})
    assert str(exc.value).endswith("k10, k11")  # twelve keys: all shown, no ellipsis


@pytest.mark.parametrize("dist", ["normal", "uniform"])
def test_mimetic_v_proj_is_the_stated_product_of_float64_draws(dist):
    """``A = alpha Z - beta I`` with Z drawn in float64 from the generator (N(0, I/D), or U(+-sqrt(3/D))
    per entry), and ``W_V W_proj = A``."""
    import math

    dim, alpha, beta = 12, 0.7, 0.4
    w_v, w_p, a = mimetic_v_proj(dim, alpha, beta, torch.Generator().manual_seed(5), dist=dist)
    g = torch.Generator().manual_seed(5)
    if dist == "uniform":
        z = (2 * torch.rand(dim, dim, generator=g, dtype=torch.float64) - 1) * math.sqrt(3.0 / dim)
    else:
        z = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    want = alpha * z - beta * torch.eye(dim, dtype=torch.float64)
    torch.testing.assert_close(a, want.float(), rtol=0, atol=0)
    torch.testing.assert_close(w_v @ w_p, want.float(), rtol=1e-5, atol=1e-5)


def test_a_part_is_read_as_a_float32_copy_whatever_the_checkpoint_holds():
    from structinit.init.inject import Part, read_part

    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        sd = {"w": torch.arange(24, dtype=dtype).reshape(6, 4)}
        rows, cols = read_part(sd, Part("w", 2, 4)), read_part(sd, Part("w", 1, 3, transposed=True))
        assert rows.dtype == cols.dtype == torch.float32
        assert rows.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]] and cols.tolist() == [list(range(1, 24, 4)),
                                                                                         list(range(2, 24, 4))]
        rows += 1
        assert sd["w"][2, 0] == 8  # a copy


def test_causal_offsets_on_a_model_attending_both_ways_are_refused_naming_both():
    from types import SimpleNamespace

    from structinit.init.impulse_checks import check_causal

    with pytest.raises(UsageError) as e:
        check_causal(SimpleNamespace(causal=False, layout="hf-bert"), True)
    assert says(e.value.render(lambda n: f"--{n}"), "--causal", "causal mask", "hf-bert", "both directions")
    with pytest.raises(UsageError) as e:
        check_causal(SimpleNamespace(causal=True, layout="hf-gpt2"), False)
    assert says(e.value.render(lambda n: f"--{n}"), "hf-gpt2", "earlier tokens", "pass --causal")
    check_causal(SimpleNamespace(causal=None, layout="timm-vit"), True)  # unknown: either is accepted
    check_causal(SimpleNamespace(causal=None, layout="timm-vit"), False)
