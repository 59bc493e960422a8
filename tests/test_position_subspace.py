"""The position subspace (``position_subspace=true``): k directions of the residual stream hold the
position table alone at init, every writer of the stream is projected out of them, and Q/K read
only them, so that a model whose tokens carry more content dimensions than its stream (16x16x3
patches in ViT-T/S/B; here 8x8x3 patches into dim 48) is structured in every layer on real images
no fit saw. Checked on real timm and Hugging Face models, with the attention measured by the
test's own hooks, and on crops of a real photo (scikit-learn's sample images)."""

import math

import numpy as np
import pytest
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.geometry.embedding import sincos
from structinit.init.initialize import initialize, initialize_model
from structinit.init.position_subspace import auto_dims, subspace_basis

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DIM, HEADS, DEPTH = 48, 3, 3
FIT = dict(data_fit=100)


def big_patch_vit(seed=0, dim=DIM, heads=HEADS):
    """A stock timm ViT (class token, learned position embedding) whose 8x8x3 patches (192 values)
    exceed its residual stream (dim 48): the 16x16-patch regime at 32 pixels, a 4x4 grid."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=dim,
                             depth=DEPTH, num_heads=heads, num_classes=10)


@pytest.fixture(scope="module")
def photo_crops():
    """64 real 32-pixel crops of scikit-learn's first sample photo (128-pixel crops averaged 4x4),
    normalized per channel: inputs no fit in this file sees."""
    from sklearn.datasets import load_sample_images

    img = torch.from_numpy(load_sample_images().images[0]).permute(2, 0, 1).float() / 255
    rng = np.random.default_rng(1)
    out = []
    for _ in range(64):
        y, x = rng.integers(0, img.shape[1] - 128), rng.integers(0, img.shape[2] - 128)
        out.append(torch.nn.functional.avg_pool2d(img[None, :, y:y + 128, x:x + 128], 4)[0])
    x = torch.stack(out)
    return (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True)


def hits_per_layer(model, x, report):
    """Share of grid query rows whose attention's argmax is the head's offset, per layer, from the
    qkv outputs caught by forward hooks of the test's own."""
    seen = []
    hooks = [blk.attn.qkv.register_forward_hook(lambda m, i, o: seen.append(o.detach())) for blk in model.blocks]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    gh, gw = report["grid"]
    heads, out = report["heads"], []
    for qkv, layer in zip(seen, report["layers"]):
        b, t, three_d = qkv.shape
        d = three_d // 3 // heads
        q, k, _ = qkv.reshape(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
        prefix = t - gh * gw
        hit = total = 0
        for head, (dy, dx) in enumerate(layer["offsets"]):
            for y in range(gh):
                for x_ in range(gw):
                    if 0 <= y + dy < gh and 0 <= x_ + dx < gw:
                        row = attn[:, head, prefix + y * gw + x_]
                        hit += int((row.argmax(-1) == prefix + (y + dy) * gw + x_ + dx).sum())
                        total += row.shape[0]
        out.append(hit / total)
    return out


def test_the_default_size_is_the_head_dim_at_most_a_quarter_of_the_stream():
    assert auto_dims(192, 3) == 48 and auto_dims(384, 6) == 64 and auto_dims(768, 12) == 64
    assert auto_dims(64, 4) == 16 and auto_dims(48, 3) == 12 and auto_dims(32, 2) == 8
    assert auto_dims(64, 4, ndim=1) == 16 and auto_dims(40, 8, ndim=1) == 4 and auto_dims(40, 8) == 4


def test_the_basis_is_orthonormal_seeded_and_leaves_layernorms_mean_alone():
    b = subspace_basis(48, 12, seed=0)
    assert b.shape == (48, 12)
    assert torch.allclose(b.T @ b, torch.eye(12), atol=1e-5)
    assert float((torch.ones(48) @ b).abs().max()) < 1e-5  # the all-ones direction is outside it
    assert torch.equal(b, subspace_basis(48, 12, seed=0)) and not torch.allclose(b, subspace_basis(48, 12, seed=1))


def test_the_subspace_holds_the_table_alone_and_qk_read_only_it():
    model = big_patch_vit()
    report = initialize_model(model, "impulse", position_subspace=True, **FIT)
    k = report["position_subspace"]["dims"]
    gain = report["position_subspace"]["gain"]
    assert k == 12 and gain == pytest.approx(2.0)  # sqrt(48 / 12): the energy of the full table x1
    b = subspace_basis(DIM, k, seed=0)
    sd = model.state_dict()
    table = gain * torch.from_numpy(sincos((4, 4), k)) @ b.T
    assert torch.allclose(sd["pos_embed"][0, 1:], table, atol=1e-5)

    def outside(w, transposed=False):  # the largest component of an output inside the subspace
        rows = w.reshape(w.shape[0], -1) if w.dim() > 1 and not (w.dim() == 3 and w.shape[0] == 1) else w
        if w.dim() == 3 and w.shape[0] == 1:
            return float((w[0] @ b).abs().max())
        if rows.dim() == 1:
            return float((rows @ b).abs().max())
        return float((b.T @ rows).abs().max())

    writers = ["patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token"]
    for i in range(DEPTH):
        writers += [f"blocks.{i}.attn.proj.weight", f"blocks.{i}.attn.proj.bias", f"blocks.{i}.mlp.fc2.weight",
                    f"blocks.{i}.mlp.fc2.bias"]
    for key in writers:
        assert outside(sd[key]) < 1e-5, key
        assert key in report["position_subspace"]["projected"], key
    assert float((sd["pos_embed"][0, :1] @ b).abs().max()) < 1e-5  # the class token's row too
    for i in range(DEPTH):
        w = sd[f"blocks.{i}.attn.qkv.weight"][:2 * DIM]  # q and k rows: each reads x @ row
        assert torch.allclose(w @ b @ b.T, w, atol=1e-5), i  # nothing outside the subspace
        assert float(sd[f"blocks.{i}.attn.qkv.bias"][:2 * DIM].abs().max()) == 0.0


def test_where_content_fills_the_stream_only_the_subspace_structures_every_layer(photo_crops):
    whole = big_patch_vit()
    rep_whole = initialize_model(whole, "impulse", **FIT)
    sub = big_patch_vit()
    rep_sub = initialize_model(sub, "impulse", position_subspace=True, **FIT)
    got_whole = hits_per_layer(whole, photo_crops, rep_whole)
    got_sub = hits_per_layer(sub, photo_crops, rep_sub)
    assert min(got_sub) >= 0.95, got_sub
    assert max(got_whole) < 0.8, got_whole  # the same fit on the whole stream: content wins
    fit = [r["hit_rate"] for r in rep_sub["data_fit"]["layers"]]  # on its own noise inputs
    assert min(fit) >= 0.95 and len(fit) == DEPTH


def test_the_subspace_is_written_the_same_on_every_path_and_seeded():
    a, b, c = big_patch_vit(), big_patch_vit(), big_patch_vit()
    initialize_model(a, "impulse", position_subspace=True, **FIT)
    initialize_model(b, "impulse", position_subspace=True, **FIT)  # the fitted artifact from the cache
    initialize_model(c, "impulse", position_subspace=True, seed=1, **FIT)
    for key, value in a.state_dict().items():  # a's fit projected its layers once more: equal to rounding
        assert torch.allclose(value, b.state_dict()[key], atol=1e-6), key
    assert not torch.allclose(a.state_dict()["pos_embed"], c.state_dict()["pos_embed"])  # another basis


def test_its_size_is_a_parameter_and_its_keys_are_new():
    from structinit.init.registry import init_spec

    plain = init_spec("impulse")
    assert "position_subspace" not in plain.to_dict()["params"]  # committed run keys stay what they were
    assert "position_dims" not in plain.to_dict()["params"]
    on = init_spec("impulse", position_subspace=True)
    assert on.to_dict()["params"]["position_subspace"] is True and on.canonical_json() != plain.canonical_json()
    model = big_patch_vit()
    report = initialize_model(model, "impulse", position_subspace=True, position_dims=8, **FIT)
    assert report["position_subspace"]["dims"] == 8 and report["position_subspace"]["gain"] == pytest.approx(
        math.sqrt(DIM / 8))


@pytest.mark.parametrize("params, words", [
    (dict(position_dims=16), "position_dims sizes the position subspace, which is off"),
    (dict(position_subspace=True, fit_pe=True), "position_subspace and fit_pe exclude each other"),
    (dict(position_subspace=True, position_dims=-4), "position_dims must be non-negative"),
    (dict(position_keep_norms=True), "position_keep_norms rescales the tensors the position subspace projects, "
                                     "and the subspace is off"),
])
def test_settings_that_cannot_go_together_are_refused(params, words):
    from structinit.init.registry import init_spec

    with pytest.raises(UsageError, match=words):
        init_spec("impulse", **params)


@pytest.mark.parametrize("dims", [6, 48, 47])
def test_a_size_the_stream_cannot_take_is_refused_naming_it(dims):
    with pytest.raises(UsageError) as err:
        initialize_model(big_patch_vit(), "impulse", position_subspace=True, position_dims=dims, **FIT)
    assert says(str(err.value), "parameter position_dims must", "positive multiple of 4", "dim 48", f"got {dims}")


def test_a_layout_whose_writers_are_unknown_is_refused():
    mha = torch.nn.MultiheadAttention(16, 2)
    sd = {f"layer.{k}": v for k, v in mha.state_dict().items()}
    with pytest.raises(UsageError) as err:
        initialize(sd, "impulse", grid=(4, 4), heads=2, position_subspace=True)
    assert says(str(err.value), "parameter position_subspace needs", "position embedding", "stream writers")


def test_a_hugging_face_vit_gets_its_own_writers_projected(photo_crops):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=DIM, num_hidden_layers=2,
                    num_attention_heads=HEADS, intermediate_size=96, num_labels=10)
    model = ViTForImageClassification(cfg)
    report = initialize_model(model, "impulse", position_subspace=True, **FIT)
    k = report["position_subspace"]["dims"]
    b = subspace_basis(DIM, k, seed=0)
    sd = model.state_dict()
    projected = report["position_subspace"]["projected"]
    mlp_out = [key for key in projected if key.endswith("weight") and "attention" not in key and "patch" not in key]
    assert len(mlp_out) == 2  # each layer's MLP output, whatever transformers calls it
    for key in projected:
        w = sd[key]
        if w.dim() == 3:
            assert float((w[0] @ b).abs().max()) < 1e-5, key
        elif w.dim() == 1:
            assert float((w @ b).abs().max()) < 1e-5, key
        else:
            assert float((b.T @ w.reshape(w.shape[0], -1)).abs().max()) < 1e-5, key
    fit = [r["hit_rate"] for r in report["data_fit"]["layers"]]
    assert min(fit) >= 0.95, fit


def test_apply_on_a_checkpoint_writes_what_initialize_model_writes(tmp_path):
    """`apply_checkpoint` fits through the model the checkpoint describes and writes the subspace
    into the file as `initialize_model` writes it into that model (every tensor to 1e-5)."""
    from structinit.apply.checkpoint import apply_checkpoint

    torch.save(big_patch_vit().state_dict(), tmp_path / "vit.pth")
    report = apply_checkpoint(tmp_path / "vit.pth", "impulse", out=tmp_path / "sub.pth", heads=HEADS,
                              position_subspace=True, **FIT)
    assert report["pos_embed_written"].startswith("the 12-dim sin-cos table x2 in a position subspace of pos_embed")
    written = torch.load(tmp_path / "sub.pth", weights_only=True)
    model = big_patch_vit()
    initialize_model(model, "impulse", position_subspace=True, **FIT)
    for key, value in model.state_dict().items():
        assert torch.allclose(written[key], value, atol=1e-5), key


# --------------------------------------------------------------------------- the parts, one by one

def test_the_default_size_follows_the_tables_step_on_an_image_and_on_a_sequence():
    """dim 24 with 4 heads: the head dim 6 is a multiple of 2 (a sequence's table) but not of 4 (an
    image's), so the two round it differently; an image grid is the default."""
    assert auto_dims(24, 4) == 4 and auto_dims(24, 4, ndim=2) == 4 and auto_dims(24, 4, ndim=1) == 6


@pytest.mark.parametrize("k, dim, ndim, ok", [
    (0, 48, 2, False), (4, 48, 2, True), (6, 48, 2, False), (44, 48, 2, True),
    (2, 48, 1, True), (4, 48, 1, True), (8, 9, 1, False), (8, 10, 1, True)])
def test_a_size_is_positive_a_multiple_of_the_tables_step_and_below_the_stream_less_one(k, dim, ndim, ok):
    from structinit.init.position_subspace import check_dims

    if ok:
        check_dims(k, dim, ndim)
    else:
        with pytest.raises(UsageError) as err:
            check_dims(k, dim, ndim)
        assert says(str(err.value), "position_dims", f"multiple of {4 if ndim == 2 else 2}", f"dim {dim}", f"got {k}")


def test_the_basis_draw_is_pinned():
    """The basis is part of what an artifact or run key stands for: another draw from the same seed
    needs a new fit version. Pinned on the values of seed 0."""
    b = subspace_basis(8, 4, seed=0)
    got = [float(b[i, j]) for i, j in ((0, 0), (1, 2), (3, 3), (7, 1))]
    assert got == pytest.approx([-0.099789, 0.272913, -0.693135, -0.540385], abs=2e-6)


def test_every_tensor_layout_is_projected_out_of_the_subspace_and_keeps_the_rest():
    """A Linear ``[D, in]``, a bias ``[D]``, a conv ``[D, C, kh, kw]``, prefix tokens ``[1, 2, D]`` (a
    class and a register token), a float16 weight (kept float16) and a Conv1D ``[in, D]``: each loses
    its part in ``B`` and keeps the rest, and is named once in ``projected``."""
    from structinit.init.position_subspace import PositionSubspace

    ps = PositionSubspace(4, 2.0, subspace_basis(12, 4, 0))
    b = ps.basis
    g = torch.Generator().manual_seed(0)
    sd = {"lin": torch.randn(12, 5, generator=g), "bias": torch.randn(12, generator=g),
          "conv": torch.randn(12, 3, 2, 2, generator=g), "prefix": torch.randn(1, 2, 12, generator=g),
          "half": torch.randn(12, 5, generator=g).half()}
    before = {k: v.clone() for k, v in sd.items()}
    ps._project(sd, list(sd), transposed=False)
    assert float((b.T @ sd["lin"]).abs().max()) < 1e-5 and float((sd["bias"] @ b).abs().max()) < 1e-5
    assert float((b.T @ sd["conv"].reshape(12, -1)).abs().max()) < 1e-5
    assert float((sd["prefix"] @ b).abs().max()) < 1e-5
    assert torch.allclose(sd["lin"], before["lin"] - b @ (b.T @ before["lin"]), atol=1e-5)
    assert sd["half"].dtype == torch.float16
    want = before["half"].float() - b @ (b.T @ before["half"].float())
    assert torch.allclose(sd["half"].float(), want, atol=1e-2)
    ps._project(sd, ["lin"], transposed=False)
    assert ps.projected == ["lin", "bias", "conv", "prefix", "half"]
    conv1d = {"c_proj": torch.randn(5, 12, generator=g)}
    ps._project(conv1d, ["c_proj"], transposed=True)
    assert float((conv1d["c_proj"] @ b).abs().max()) < 1e-5


def test_keep_norms_scales_each_projected_tensor_back_to_its_own_norm_and_stays_out_of_b():
    """``position_keep_norms``: each projected tensor is the plain projection times its norm before
    over its norm after (per tensor), still empty in ``B``; the report, the run key and the data
    fit's key say so, and only the projected tensors differ from the plain subspace."""
    from structinit.init.registry import init_spec

    plain, kept = big_patch_vit(), big_patch_vit()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    rep_plain = initialize_model(plain, "impulse", position_subspace=True, data_fit=0)
    rep_kept = initialize_model(kept, "impulse", position_subspace=True, position_keep_norms=True, data_fit=0)
    assert rep_kept["position_subspace"]["keep_norms"] is True
    assert "keep_norms" not in rep_plain["position_subspace"]
    projected = rep_kept["position_subspace"]["projected"]
    assert projected == rep_plain["position_subspace"]["projected"] and "patch_embed.proj.weight" in projected
    b = subspace_basis(DIM, rep_kept["position_subspace"]["dims"], seed=0)
    sp, sk = plain.state_dict(), kept.state_dict()
    only_projected = ["patch_embed.proj.weight", "cls_token"] + [f"blocks.{i}.mlp.fc2.weight" for i in range(DEPTH)]
    for key in projected:
        if float(sp[key].norm()) == 0:  # a zero bias stays zero
            assert float(sk[key].norm()) == 0, key
            continue
        ratio = float(sk[key].norm() / sp[key].norm())
        assert ratio > 1.0 + 1e-4, key  # the projection took some of each tensor's norm, given back
        assert torch.allclose(sk[key], sp[key] * ratio, atol=1e-5), key  # the same direction
        if key in only_projected:  # nothing but the projection wrote it: its norm before the init
            assert float(sk[key].norm()) == pytest.approx(float(before[key].norm()), rel=1e-5), key
        flat = sk[key].reshape(-1, DIM) if sk[key].dim() == 3 else sk[key].reshape(DIM, -1).T
        assert float((flat @ b).abs().max()) < 1e-5, key
    for key in sp:
        if key not in projected:
            assert torch.allclose(sp[key], sk[key]), key  # Q/K, V, the table: as the plain subspace writes them
    on = init_spec("impulse", position_subspace=True, position_keep_norms=True)
    off = init_spec("impulse", position_subspace=True)
    assert "position_keep_norms" not in off.to_dict()["params"]
    assert on.to_dict()["params"]["position_keep_norms"] is True and on.canonical_json() != off.canonical_json()
    assert on.fit_settings(object.__new__(type("S", (), {"dims": 12, "gain": 2.0, "rest_scale": 0.0,
                                                            "keep_norms": True}))).writes["position_keep_norms"]


def test_the_table_with_its_rest_holds_the_k_dim_table_in_b_and_the_full_table_outside():
    from structinit.geometry.grid import Grid
    from structinit.init.position_subspace import PositionSubspace

    grid = Grid((4, 4))
    ps = PositionSubspace(8, 3.0, subspace_basis(24, 8, 0), rest_scale=1.5)
    out = ps.table(grid)
    assert out.shape == (16, 24)
    assert torch.allclose(out @ ps.basis, 3.0 * torch.from_numpy(sincos(grid, 8)).float(), atol=1e-5)
    rest = 1.5 * torch.from_numpy(sincos(grid, 24)).float() @ ps.complement()
    assert torch.allclose(out @ ps.complement(), rest, atol=1e-5)
    assert ps.record() == {"dims": 8, "gain": 3.0, "projected": []}
    assert PositionSubspace(16, math.sqrt(12), ps.basis).record()["gain"] == 3.464102  # six decimals


def test_a_table_too_long_for_the_position_embedding_is_refused():
    from types import SimpleNamespace

    from structinit.geometry.grid import Grid
    from structinit.init.position_subspace import PositionSubspace

    ps = PositionSubspace(4, 1.0, subspace_basis(12, 4, 0))
    for shape in ((1, 15, 12), (15, 12)):  # 15 rows for a 4x4 grid; a 2-D table
        t = SimpleNamespace(sd={"pos_embed": torch.zeros(shape)}, pos_key="pos_embed", grid=Grid((4, 4)))
        with pytest.raises(UsageError, match=rf"pos_embed of shape \[{', '.join(map(str, shape))}\] cannot hold the "
                                             "4x4 grid"):
            ps.write_table(t)


def sequence_model(seed=0):
    from structinit.training.sequence_models import SequenceTransformer

    torch.manual_seed(seed)
    return SequenceTransformer(40, 1, 10, dim=24, heads=4, depth=2)


def test_a_sequence_takes_the_sequences_step_its_pe_scale_and_its_rest():
    """A 1-D transformer (MNIST-1D's, timm blocks, dim 24, 4 heads): the default size is a multiple
    of 2 (6, where an image's would be 4); ``pe_scale`` scales the gain; ``position_rest`` writes the
    full table x pe_scale outside the subspace; without it nothing of the table is outside."""
    from structinit.geometry.grid import Grid

    report = initialize_model(sequence_model(), "impulse", position_subspace=True, data_fit=5)
    assert report["position_subspace"]["dims"] == 6 and report["position_subspace"]["gain"] == pytest.approx(2.0)
    model = sequence_model()
    report = initialize_model(model, "impulse", position_subspace=True, data_fit=5, pe_scale=2.0, position_rest=True,
                              seed=3)
    assert report["position_subspace"]["gain"] == pytest.approx(4.0)
    b = subspace_basis(24, 6, seed=3)
    pe = model.pos_embed.detach()[0]
    c = torch.eye(24) - b @ b.T
    assert torch.allclose(pe @ c, 2.0 * torch.from_numpy(sincos(Grid((40,)), 24)).float() @ c, atol=1e-4)
    plain = sequence_model()
    initialize_model(plain, "impulse", position_subspace=True, data_fit=5, seed=3)
    assert float((plain.pos_embed.detach()[0] @ c).abs().max()) < 1e-5


def test_a_model_without_a_position_embedding_or_a_writer_is_refused():
    import timm

    from structinit.errors import StructinitError

    torch.manual_seed(0)
    no_pe = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=DIM,
                              depth=1, num_heads=HEADS, num_classes=10, pos_embed="none")
    with pytest.raises(UsageError) as err:
        initialize(no_pe.state_dict(), "impulse", grid=(4, 4), heads=HEADS, position_subspace=True)
    assert says(str(err.value), "position_subspace", "position embedding")
    sd = big_patch_vit().state_dict()
    del sd["blocks.1.mlp.fc2.weight"]
    with pytest.raises(StructinitError) as err:
        initialize(sd, "impulse", grid=(4, 4), heads=HEADS, position_subspace=True)
    assert says(str(err.value), "parameter position_subspace: layer 1", "blocks.1.mlp.fc2.weight", "residual stream")


def test_an_image_grid_takes_the_images_step_and_the_rest_is_off_unless_asked():
    """dim 24 with 4 heads on a 4x4 grid: 4 (a multiple of 4), where a sequence of that model takes 6;
    the full table's rest outside the subspace is written only when asked for."""
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.position_subspace import PositionSubspace

    report = initialize_model(big_patch_vit(dim=24, heads=4), "impulse", position_subspace=True, data_fit=5)
    assert report["position_subspace"]["dims"] == 4
    t = AttentionTarget(sequence_model(), None, None, None, need_grid=True)
    plain = PositionSubspace.for_target(t, 0, None, seed=0)
    assert plain.rest_scale == 0.0 and plain.keep_norms is False  # neither unless asked for
    assert PositionSubspace.for_target(t, 0, 2.0, seed=0, rest=True).rest_scale == 2.0
