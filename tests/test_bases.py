"""The bases of the other weights (``base`` of impulse and mimetic): exactly which modules each one
resets, on timm's ViT and on Hugging Face's (transformers 5 names its MLP ``mlp.fc1``/``fc2``), and
the refusal of a base that would reset nothing. Checked by comparing every tensor before and after."""

import pytest
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.init.initialize import initialize_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def timm_vit(seed=0):
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=2, in_chans=1,
                             embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10, class_token=False,
                             global_pool="avg")


def hf_vit(seed=0):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=10)
    return ViTForImageClassification(cfg)


def changed(before, model):
    return sorted(k for k, v in model.state_dict().items() if not torch.equal(v, before[k]))


def written_by_mimetic(model):
    """What mimetic writes on the model's own base (its Q/K, V and output projections)."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    initialize_model(model, "mimetic")
    return set(changed(before, model))


@pytest.mark.parametrize("build, mlp, head", [
    (timm_vit, ["blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight", "blocks.0.mlp.fc2.bias",
                "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1.bias", "blocks.1.mlp.fc2.weight", "blocks.1.mlp.fc2.bias"],
     ["head.bias", "head.weight"]),
    (hf_vit, ["vit.layers.0.mlp.fc1.weight", "vit.layers.0.mlp.fc1.bias", "vit.layers.0.mlp.fc2.weight",
              "vit.layers.0.mlp.fc2.bias", "vit.layers.1.mlp.fc1.weight", "vit.layers.1.mlp.fc1.bias",
              "vit.layers.1.mlp.fc2.weight", "vit.layers.1.mlp.fc2.bias"],
     ["classifier.bias", "classifier.weight"]),
])
def test_each_partial_base_resets_exactly_its_modules(build, mlp, head):
    own = written_by_mimetic(build())
    for base, want in (("pytorch-mlp", mlp), ("pytorch-head", head)):
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if not set(want) <= set(before):  # transformers' own naming of this version
            pytest.skip(f"this transformers names its modules otherwise: {sorted(before)[:4]}")
        report = initialize_model(model, "mimetic", base=base)
        assert sorted(set(changed(before, model)) - own) == sorted(want), base
        assert report["base_reset"] == len(want) // 2  # Linear modules: a weight and a bias each


def test_pytorch_resets_every_module_and_model_none():
    model = timm_vit(seed=3)  # built from another seed than the reset's, which would redraw the first module alike
    before = {k: v.clone() for k, v in model.state_dict().items()}
    initialize_model(model, "mimetic", base="pytorch")
    resettable = [k for k in before if not k.startswith("pos_embed")]
    assert set(changed(before, model)) >= {k for k in resettable if "norm" not in k}  # LayerNorms start at 1 and 0
    model = timm_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = initialize_model(model, "mimetic", base="model")
    assert "base_reset" not in report and set(changed(before, model)) == written_by_mimetic(timm_vit())


def test_a_base_that_would_reset_nothing_is_refused_naming_what_it_resets():
    model = timm_vit()  # its MLPs renamed (as transformers 4 names them otherwise) and no classifier
    for blk in model.blocks:
        blk.ffn = blk.mlp
        del blk.mlp
        blk.mlp = torch.nn.Identity()
    model.head = torch.nn.Identity()
    with pytest.raises(UsageError) as err:
        initialize_model(model, "mimetic", base="pytorch-mlp")
    assert says(str(err.value), "base pytorch-mlp", "'mlp'", "VisionTransformer has none", "reset nothing")
    with pytest.raises(UsageError) as err:
        initialize_model(model, "impulse", base="pytorch-head", data_fit=0)
    assert says(str(err.value), "base pytorch-head", "classifier", "reset nothing")


def test_inits_that_keep_the_users_weights_say_which_base_trained_better_from_scratch(tmp_path, cli):
    from structinit.init.baselines import SCRATCH_BASE
    from structinit.training.config import TRAIN_BASE

    assert TRAIN_BASE == SCRATCH_BASE == "pytorch-mlp"  # train's default is the base the note names
    note = ("the weights {} does not write are kept as they are (base=model); for a model trained from scratch "
            "base=pytorch-mlp (the MLPs at PyTorch's default, structinit train's default) trained better on "
            "Fashion-MNIST and digits")
    assert initialize_model(timm_vit(), "mimetic")["base_note"] == note.format("mimetic")
    assert "base_note" not in initialize_model(timm_vit(), "mimetic", base="pytorch-mlp")
    assert "base_note" not in initialize_model(timm_vit(), "trunc-normal")
    torch.save(timm_vit().state_dict(), tmp_path / "vit.pth")
    r = cli("apply", tmp_path / "vit.pth", "--heads", "4", "--method", "mimetic", "--out", tmp_path / "o.pth")
    assert r.returncode == 0 and f"  other weights: {note.format('mimetic')}" in r.stdout.splitlines()
