"""Conditioned init ("Conditioned Initialization for Attention"): per head Q and K semi-orthogonal
(condition number 1) at ``qk_scale``, V the identity on the head's own rows at ``v_scale``, the
query/key/value biases zeroed, the rest from ``base``; through ``initialize_model``, ``structinit
train`` and ``structinit apply``."""

import json

import pytest
import torch
from conftest import error_line, says

from structinit.errors import UsageError
from structinit.init.attention_target import AttentionTarget
from structinit.init.conditioned import ConditionedInit, head_condition_numbers, semi_orthogonal
from structinit.init.initialize import initialize_model
from structinit.init.inject import read_qk
from structinit.init.registry import init_spec, parse_init

DIM, HEADS = 48, 4


def vit(seed=0, **kwargs):
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", img_size=28, patch_size=7, embed_dim=DIM, depth=2,
                             num_heads=HEADS, class_token=False, global_pool="avg", num_classes=10, **kwargs)


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


def qkv(model, layer):
    return model.blocks[layer].attn.qkv.weight.detach(), model.blocks[layer].attn.qkv.bias.detach()


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_semi_orthogonal_has_every_singular_value_at_the_scale(scale):
    w = semi_orthogonal(5, 16, 4, scale, torch.Generator().manual_seed(0))
    assert w.shape == (5, 16, 4)
    gram = w.double().transpose(-1, -2) @ w.double()
    assert torch.allclose(gram, scale ** 2 * torch.eye(4, dtype=torch.float64).expand(5, 4, 4), atol=1e-5)
    assert max(head_condition_numbers(w)) == pytest.approx(1.0, abs=1e-5)
    assert head_condition_numbers(torch.tensor([[[2.0, 0.0], [0.0, 0.5]]])) == [4.0]
    # fresh per head: no two heads span the same columns
    assert not torch.allclose(w[0], w[1], atol=1e-3)


def test_q_and_k_are_semi_orthogonal_per_head_and_v_the_identity_on_its_rows():
    model = vit()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.bias.fill_(0.3)  # to be zeroed
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = initialize_model(model, "conditioned", qk_scale=0.7, v_scale=1.5, seed=4)
    assert report["method"] == "conditioned" and report["params"] == {"qk_scale": 0.7, "v_scale": 1.5, "base": "model"}
    target = AttentionTarget(model)
    for layer, slot in enumerate(target.slots):
        q, k = read_qk(target.sd, slot, HEADS)  # [H, D, d]
        for w in (q, k):
            s = torch.linalg.svdvals(w.double())
            assert torch.allclose(s, torch.full_like(s, 0.7), atol=1e-5)  # condition number 1 at the scale
        assert not torch.allclose(q, k, atol=1e-2)  # drawn independently
        weight, bias = qkv(model, layer)
        d = DIM // HEADS
        for h in range(HEADS):  # each head's value rows select its own d coordinates of the stream
            rows = weight[2 * DIM + h * d: 2 * DIM + (h + 1) * d]
            expected = torch.zeros(d, DIM)
            expected[:, h * d:(h + 1) * d] = 1.5 * torch.eye(d)
            assert torch.equal(rows, expected)
        assert torch.equal(bias, torch.zeros(3 * DIM))
        row = report["layers"][layer]
        assert row["qk_condition"] == pytest.approx(1.0, abs=1e-5) and row["v_identity_error"] < 1e-6
        assert row["replaced"] == [f"blocks.{layer}.attn.qkv.weight[0:48]", f"blocks.{layer}.attn.qkv.weight[48:96]",
                                   f"blocks.{layer}.attn.qkv.bias[0:48]", f"blocks.{layer}.attn.qkv.bias[48:96]",
                                   f"blocks.{layer}.attn.qkv.weight[96:144]", f"blocks.{layer}.attn.qkv.bias[96:144]"]
    after = model.state_dict()
    # base=model: nothing but Q/K/V and their biases changed (the output projection is the base's)
    changed = sorted(key for key in before if not torch.equal(before[key], after[key]))
    assert changed == ["blocks.0.attn.qkv.bias", "blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.bias",
                       "blocks.1.attn.qkv.weight"]


def test_the_seed_draws_the_weights_and_the_base_resets_the_rest():
    a, b, c = vit(), vit(), vit()
    initialize_model(a, "conditioned", seed=1)
    initialize_model(b, "conditioned", seed=1)
    initialize_model(c, "conditioned", seed=2)
    assert torch.equal(qkv(a, 0)[0], qkv(b, 0)[0]) and not torch.equal(qkv(a, 0)[0][:DIM], qkv(c, 0)[0][:DIM])
    assert not torch.equal(qkv(a, 0)[0][:DIM], qkv(a, 1)[0][:DIM])  # fresh per layer
    p = vit()
    fc1 = p.blocks[0].mlp.fc1.weight.detach().clone()
    report = initialize_model(p, "conditioned", base="pytorch", seed=1)
    assert report["base_reset"] > 0 and not torch.equal(p.blocks[0].mlp.fc1.weight, fc1)
    assert torch.equal(qkv(p, 0)[0], qkv(a, 0)[0])  # the init's own draws do not depend on the base


def test_bad_parameters_are_refused_by_name():
    from structinit.init.baselines import BASES

    assert says(rendered(init_spec, "conditioned", qk_scale=0), "conditioned", "<qk_scale>", "positive", "got 0.0")
    assert says(rendered(init_spec, "conditioned", v_scale=-1), "conditioned", "<v_scale>", "positive", "got -1.0")
    assert says(rendered(parse_init, "conditioned", ["qk_scale=big"]), "conditioned", "<qk_scale>", "a number",
                "'big'")
    assert says(rendered(init_spec, "conditioned", base="xavier"), "unknown <base> 'xavier'", ", ".join(BASES))
    assert says(rendered(init_spec, "conditioned", alpha1=0.5), "'conditioned'", "no parameter <alpha1>",
                "qk_scale, v_scale, base")
    assert init_spec("conditioned").to_dict() == {"method": "conditioned",
                                                  "params": {"qk_scale": 2.0, "v_scale": 1.0, "base": "model"}}
    assert ConditionedInit(qk_scale="2") == init_spec("conditioned", qk_scale=2.0)


def test_structinit_train_runs_it_on_the_train_base(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "conditioned", "-p", "qk_scale=3",
            "--epochs", "1", "--train-size", "64", "--patch", "2", "--depth", "1", "--dim", "32", "--heads", "2",
            "--batch-size", "32", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "config.json").read_text())
    assert doc["config"]["init"] == "conditioned"
    assert doc["config"]["init_params"] == {"qk_scale": 3, "base": "pytorch-mlp"}
    layers = doc["init_report"]["layers"]
    assert len(layers) == 1 and layers[0]["qk_condition"] == pytest.approx(1.0, abs=1e-5)


def test_structinit_apply_writes_it_into_a_checkpoint(cli, tmp_path):
    from structinit.init.checkpoints import load_checkpoint

    torch.save(vit().state_dict(), tmp_path / "vit.pth")
    r = cli("apply", tmp_path / "vit.pth", "--heads", str(HEADS), "--method", "conditioned", "-p", "v_scale=0.5",
            "--seed", "3", "--out", tmp_path / "out.pth", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["method"] == "conditioned"
    model = vit()
    initialize_model(model, "conditioned", v_scale=0.5, seed=3)
    written = load_checkpoint(tmp_path / "out.pth").state_dicts[0][1]
    for key in ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias"):
        assert torch.equal(torch.as_tensor(written[key]), model.state_dict()[key])
    refused = cli("apply", tmp_path / "vit.pth", "--heads", str(HEADS), "--method", "conditioned", "-p", "qk_scale=-2",
                  "--out", tmp_path / "bad.pth")
    assert refused.returncode == 2 and not (tmp_path / "bad.pth").exists()
    assert says(error_line(refused.stderr), "error: ", "conditioned", "qk_scale", "positive", "got -2.0")
