"""H4 of the conditioned-init research: each head split by direction. The impulse Q/K in a position
subspace keep their logits exactly, and ``content_qk`` adds Q/K that read only the content directions,
in the head columns the position part leaves free (structinit.init.content_qk)."""

import pytest
import torch
from conftest import error_line, says

from structinit.errors import StructinitWarning, UsageError
from structinit.init.content_qk import content_basis, content_columns, position_columns, with_content
from structinit.init.initialize import initialize_model
from structinit.init.position_subspace import subspace_basis
from structinit.init.registry import init_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed=0):
    """16x16 images in 4x4 patches into dim 32, 4 heads (head dim 8): a 4x4 grid whose tokens' 16
    values fill half the stream; a 4-direction subspace leaves each head 4 columns."""
    from structinit.training.models import ModelConfig, build_model

    return build_model(ModelConfig("vit-digits", patch=4, dim=32), num_classes=10, image_size=16, in_chans=1,
                       seed=seed)


def _qk(model, layer):
    """``(q, k)`` of ``layer``: ``[H, D, d]`` each (timm's fused qkv, ``x @ W`` convention)."""
    w = model.blocks[layer].attn.qkv.weight.detach()
    d_model, heads = w.shape[1], model.blocks[layer].attn.num_heads
    q, k = w[:d_model], w[d_model:2 * d_model]
    return (q.T.reshape(d_model, heads, -1).permute(1, 0, 2), k.T.reshape(d_model, heads, -1).permute(1, 0, 2))


def _init(cache, **params):
    model = _model()
    report = initialize_model(model, "impulse", position_subspace=True, position_dims=4, data_fit=0, seed=0,
                              cache_dir=cache, **params)
    return model, report


def test_the_position_part_is_refactored_into_k_columns_with_the_same_product():
    basis = subspace_basis(32, 4, 0)
    gen = torch.Generator().manual_seed(1)
    q = basis @ torch.randn(3, 4, 8, generator=gen)
    k = basis @ torch.randn(3, 4, 8, generator=gen)
    qp, kp = position_columns(q, k, basis)
    assert qp.shape == (3, 32, 4) and kp.shape == (3, 32, 4)
    assert torch.allclose(qp @ kp.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)


@pytest.mark.parametrize("method", ["mimetic", "conditioned"])
def test_the_content_part_reads_only_the_content_directions_at_its_scale(method):
    basis = subspace_basis(32, 4, 0)
    u = content_basis(basis)
    assert u.shape == (32, 28) and torch.allclose(u.T @ u, torch.eye(28), atol=1e-5)
    assert float((basis.T @ u).abs().max()) < 1e-5
    one = content_columns(method, 4, basis, 4, 1.0, torch.Generator().manual_seed(2))
    four = content_columns(method, 4, basis, 4, 4.0, torch.Generator().manual_seed(2))
    for w in one:
        assert w.shape == (4, 32, 4) and float((basis.T @ w).abs().max()) < 1e-5  # blind to position
    assert torch.allclose(four[0] @ four[1].transpose(-1, -2), 4 * one[0] @ one[1].transpose(-1, -2), atol=1e-4)
    if method == "conditioned":  # semi-orthogonal at conditioned init's scale 2: every singular value 2
        s = torch.linalg.svdvals(one[0].double())
        assert torch.allclose(s, torch.full_like(s, 2.0), atol=1e-5)
    else:  # mimetic: the best rank-4 factor of 0.7 Z + 0.7 I, whose diagonal is about 0.7 on average
        a = u.T @ (one[0] @ one[1].transpose(-1, -2)) @ u
        assert 0.05 < float(a.diagonal(dim1=-2, dim2=-1).mean()) < 0.7


def test_mimetic_content_is_the_best_rank_r_factor_of_mimetic_inits_target_on_the_content_directions():
    """Per head ``0.7 Z + 0.7 I`` (``Z ~ N(0, I/n)`` on the ``n`` content directions, drawn first from the
    generator): the content part's bilinear form, in content coordinates, is its best rank-4 approximation."""
    import math

    basis = subspace_basis(32, 4, 0)
    u = content_basis(basis).double()
    qc, kc = content_columns("mimetic", 4, basis, 4, 1.0, torch.Generator().manual_seed(2))
    z = torch.randn(4, 28, 28, generator=torch.Generator().manual_seed(2), dtype=torch.float64) / math.sqrt(28)
    left, s, right = torch.linalg.svd(0.7 * z + 0.7 * torch.eye(28, dtype=torch.float64))
    best = left[:, :, :4] @ torch.diag_embed(s[:, :4]) @ right[:, :4, :]
    got = u.T @ (qc.double() @ kc.double().transpose(-1, -2)) @ u
    assert torch.allclose(got, best, atol=1e-4)
    # the two factors share the singular values evenly (each S^1/2): Q_c and K_c have equal column norms
    assert torch.allclose(qc.norm(dim=1), kc.norm(dim=1), atol=1e-4)


def test_the_content_draws_come_from_the_generator_given():
    basis = subspace_basis(32, 4, 0)
    q = basis @ torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    one = with_content(q, q, basis, "conditioned", 1.0, torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # the global generator, which must not be the one drawn from
    two = with_content(q, q, basis, "conditioned", 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    other = with_content(q, q, basis, "conditioned", 1.0, torch.Generator().manual_seed(8))
    assert not torch.equal(one[0], other[0])


def test_an_unknown_content_method_is_refused_by_the_function_too():
    with pytest.raises(ValueError) as err:
        content_columns("random", 2, subspace_basis(32, 4, 0), 4, 1.0, torch.Generator())
    says(str(err.value), "content_qk", "mimetic, conditioned", "'random'")


def test_with_content_keeps_the_position_logits_and_adds_content_ones():
    basis = subspace_basis(32, 4, 0)
    gen = torch.Generator().manual_seed(3)
    q = basis @ torch.randn(4, 4, 8, generator=gen)
    k = basis @ torch.randn(4, 4, 8, generator=gen)
    nq, nk = with_content(q, k, basis, "mimetic", 1.0, torch.Generator().manual_seed(4))
    assert nq.shape == q.shape
    pos = torch.randn(16, 4, generator=gen) @ basis.T  # tokens in the subspace alone
    assert torch.allclose(pos @ nq @ (pos @ nk).transpose(-1, -2), pos @ q @ (pos @ k).transpose(-1, -2), atol=1e-3)
    content = torch.randn(16, 32, generator=gen) @ (torch.eye(32) - basis @ basis.T)
    assert float((content @ nq @ (content @ nk).transpose(-1, -2)).abs().max()) > 0.1
    assert float((content @ q @ (content @ k).transpose(-1, -2)).abs().max()) < 1e-4


def test_a_model_gets_its_heads_split_and_the_report_says_so(tmp_path):
    plain, plain_report = _init(tmp_path)
    split, report = _init(tmp_path, content_qk="mimetic", content_scale=0.5)
    assert report.extra["content_qk"] == {"method": "mimetic", "scale": 0.5, "columns": 4}
    assert "content_qk" not in plain_report.extra
    basis = subspace_basis(32, 4, 0)
    c = torch.eye(32) - basis @ basis.T
    for layer in range(4):
        (q0, k0), (q1, k1) = _qk(plain, layer), _qk(split, layer)
        # the position part (the subspace block of Q K^T) is the plain init's, to the float
        assert torch.allclose(basis.T @ q1 @ k1.transpose(-1, -2) @ basis,
                              basis.T @ q0 @ k0.transpose(-1, -2) @ basis, atol=1e-4)
        assert float((c @ q0).abs().max()) < 1e-4  # the plain init reads no content
        assert float((c @ q1 @ k1.transpose(-1, -2) @ c).abs().max()) > 0.01  # the split one does
    # measured on the position embedding alone, content adds nothing: the same attention
    assert [r.hit_rate for r in report.layers] == pytest.approx([r.hit_rate for r in plain_report.layers], abs=1e-6)


@pytest.mark.parametrize("method", ["mimetic", "conditioned"])
def test_zero_content_keys_keep_the_attention_on_any_input_and_leave_the_queries_to_train(tmp_path, method):
    plain, _ = _init(tmp_path)
    split, report = _init(tmp_path, content_qk=method, content_zero_keys=True)
    assert report.extra["content_qk"]["zero_keys"] is True
    basis = subspace_basis(32, 4, 0)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))  # any input, content and all
    for layer in range(4):
        (q0, k0), (q1, k1) = _qk(plain, layer), _qk(split, layer)
        assert torch.allclose(x @ q1 @ (x @ k1).transpose(-1, -2), x @ q0 @ (x @ k0).transpose(-1, -2), atol=1e-3)
        assert float(k1[:, :, 4:].abs().max()) == 0.0  # the content keys
        content_q = q1[:, :, 4:]
        assert float(content_q.norm()) > 1.0 and float((basis.T @ content_q).abs().max()) < 1e-4


def test_run_keys_of_the_impulse_init_leave_the_new_parameters_out():
    assert "content_qk" not in init_spec("impulse").to_dict()["params"]
    assert "content_scale" not in init_spec("impulse", position_subspace=True).to_dict()["params"]
    params = init_spec("impulse", position_subspace=True, position_dims=4, content_qk="conditioned").to_dict()["params"]
    assert params["content_qk"] == "conditioned"


@pytest.mark.parametrize("params, parts", [
    ({"content_qk": "mimetic"}, ("content_qk", "subspace", "off", "position_subspace=True")),
    ({"position_subspace": True, "content_scale": 2.0}, ("content_scale", "content_qk='mimetic'", "none")),
    ({"position_subspace": True, "content_qk": "random"}, ("content_qk", "mimetic", "conditioned", "'random'")),
    ({"position_subspace": True, "content_qk": "mimetic", "content_scale": 0.0}, ("content_scale",)),
    ({"position_subspace": True, "content_zero_keys": True}, ("content_zero_keys", "content_qk", "none")),
    ({"position_subspace": True, "content_qk": "mimetic", "self_weight": 0.3}, ("content_qk", "self_weight",
                                                                               "exclude each other")),
])
def test_content_parameters_that_would_do_nothing_or_cannot_are_refused(params, parts):
    with pytest.raises(UsageError) as err:
        init_spec("impulse", **params)
    says(err.value.render(), *parts)  # in Python's syntax, as a caller of the library reads it


def test_a_subspace_as_wide_as_the_head_leaves_no_columns_and_is_refused(tmp_path):
    with pytest.raises(UsageError) as err:
        initialize_model(_model(), "impulse", position_subspace=True, position_dims=8, content_qk="mimetic",
                         data_fit=0, cache_dir=tmp_path)
    says(str(err.value), "content_qk", "position_dims", "8", "head dim 8", "below 8")
    with pytest.raises(UsageError) as err:  # the automatic size is the head dim here
        initialize_model(_model(), "impulse", position_subspace=True, content_qk="mimetic", data_fit=0,
                         cache_dir=tmp_path)
    says(str(err.value), "content_qk", "head dim 8")


def test_the_train_command_refuses_content_qk_without_the_subspace(cli, tmp_path):
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "impulse", "-p", "content_qk=mimetic",
            "--epochs", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and says(error_line(r.stderr), "content_qk", "-p position_subspace=true")
    assert not (tmp_path / "run").exists()


def test_what_the_init_prints_says_its_figures_are_the_position_parts(tmp_path):
    """The fit's per-layer figures are measured before the content part is written: the summary says
    so, and that drawn content logits move them on real inputs (zero keys do not)."""
    drawn = init_spec("impulse", position_subspace=True, position_dims=4, content_qk="conditioned", data_fit=0)
    _, report = _init(tmp_path, content_qk="conditioned")
    last = StructinitWarning(drawn.summary(report)[-1]).render()  # as a command renders it (Python's syntax)
    says(last, "conditioned", "content_scale 1", "4 columns", "position part", "real inputs")
    zero = init_spec("impulse", position_subspace=True, position_dims=4, content_qk="mimetic", content_zero_keys=True,
                     data_fit=0)
    _, report = _init(tmp_path, content_qk="mimetic", content_zero_keys=True)
    last = StructinitWarning(zero.summary(report)[-1]).render()
    says(last, "mimetic", "zero keys", "position part")
    assert "real inputs" not in last
    _, plain = _init(tmp_path)
    lines = init_spec("impulse", position_subspace=True, data_fit=0).summary(plain)
    assert not any("content" in line for line in lines)


def _value(model, layer):
    """``(W_V, b_V)`` of ``layer`` as stored (``[D, D]`` nn.Linear rows, ``[D]``; timm's fused qkv)."""
    attn = model.blocks[layer].attn
    d_model = attn.qkv.weight.shape[1]
    bias = attn.qkv.bias
    return (attn.qkv.weight.detach()[2 * d_model:].clone(),
            bias.detach()[2 * d_model:].clone() if bias is not None else None)


@pytest.mark.parametrize("subspace", [False, True])
def test_value_init_conditioned_writes_conditioned_inits_v_and_leaves_the_rest_as_the_mimetic_v_would(
        tmp_path, subspace):
    """H4 as the issue states it: conditioned init's V (the identity per head, bias zero) beside the
    impulse Q/K; the output projection stays at the base (projected out of the subspace when on),
    and Q/K are the same as with the mimetic V/proj."""
    params = dict(position_subspace=True, position_dims=4, content_qk="conditioned") if subspace else {}
    base = _model()
    with torch.no_grad():  # a V bias to zero, so that the test sees the write
        for block in base.blocks:
            block.attn.qkv.bias.fill_(0.5)
    model, mimetic = _model(), _model()
    model.load_state_dict(base.state_dict())
    mimetic.load_state_dict(base.state_dict())
    report = initialize_model(model, "impulse", value_init="conditioned", data_fit=0, seed=0, cache_dir=tmp_path,
                              **params)
    initialize_model(mimetic, "impulse", data_fit=0, seed=0, cache_dir=tmp_path, **params)
    basis = subspace_basis(32, 4, 0) if subspace else None
    for layer in range(len(model.blocks)):
        w_v, b_v = _value(model, layer)
        assert torch.equal(w_v, torch.eye(32)) and torch.equal(b_v, torch.zeros(32))
        assert not torch.equal(_value(mimetic, layer)[0], torch.eye(32))
        for a, b in zip(_qk(model, layer), _qk(mimetic, layer)):
            assert torch.allclose(a, b, atol=1e-6)
        proj = model.blocks[layer].attn.proj.weight.detach()
        own = base.blocks[layer].attn.proj.weight.detach()
        if basis is None:
            assert torch.equal(proj, own)  # left at the base
        else:  # the base's projection with its component in the subspace taken out
            assert float((basis.T @ proj).abs().max()) < 1e-5
            assert torch.allclose(proj, own - basis @ (basis.T @ own), atol=1e-5)
    out = report.to_dict()
    assert out["value_init"] == "conditioned"
    assert "value_init" not in initialize_model(_model(), "impulse", data_fit=0, cache_dir=tmp_path).to_dict()
    assert any(k.startswith("blocks.0.attn.qkv.bias") for k in out["layers"][0]["replaced"])
    spec = init_spec("impulse", value_init="conditioned", **params)
    assert spec.to_dict()["params"]["value_init"] == "conditioned"
    assert "value_init" not in init_spec("impulse", **params).to_dict()["params"]


@pytest.mark.parametrize("params, parts", [
    ({"value_init": "identity"}, ("unknown value_init", "'identity'", "mimetic", "conditioned")),
    ({"value_init": "conditioned", "mimetic_vproj": False}, ("parameter value_init sets V", "mimetic_vproj=False")),
    ({"value_init": "conditioned", "beta2": 0.2}, ("parameter beta2 sets the mimetic V/proj",
                                                   "which value_init='conditioned' does not write", "leave them out")),
    ({"value_init": "conditioned", "alpha2": 0.2, "beta2": 0.2}, ("parameter alpha2, beta2 set the mimetic V/proj",
                                                                  "value_init='conditioned' does not write")),
    ({"mimetic_vproj": False, "alpha2": 0.2}, ("parameter alpha2 sets the mimetic V/proj",
                                               "which mimetic_vproj=False keeps as it is",
                                               "give mimetic_vproj=True, or leave them out")),
    ({"mimetic_vproj": False, "alpha2": 0.2, "beta2": 0.2}, ("parameter alpha2, beta2 set the mimetic V/proj",)),
])
def test_value_parameters_that_would_do_nothing_are_refused(params, parts):
    with pytest.raises(UsageError) as err:
        init_spec("impulse", **params)
    says(err.value.render(), *parts)


def test_the_mimetic_v_proj_takes_its_own_parameters():
    spec = init_spec("impulse", alpha2=0.3, beta2=0.2)
    assert (spec.alpha2, spec.beta2, spec.value_init) == (0.3, 0.2, "mimetic")


def test_the_train_command_refuses_value_init_without_the_v_it_replaces(cli, tmp_path):
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "impulse", "-p",
            "value_init=conditioned", "-p", "mimetic_vproj=false", "--epochs", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and says(error_line(r.stderr), "value_init", "-p mimetic_vproj=false")
    assert not (tmp_path / "run").exists()
