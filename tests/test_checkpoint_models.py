"""Building a checkpoint's model (``structinit.apply.models``) and reading the data
fit's real inputs for it (``structinit.apply.inputs``): what a checkpoint's tensors tell, what
they do not, and what each kind of ``--data`` source becomes."""

import numpy as np
import pytest
import torch
from conftest import error_line

from structinit.apply.inputs import fit_inputs_for
from structinit.apply.models import checkpoint_model, timm_vit_kwargs
from structinit.errors import UsageError
from structinit.init.checkpoints import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rendered(call, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as e:
        call(*args, **kwargs)
    return e.value.render(lambda n: f"<{n}>")


def timm_vit(**kwargs):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    settings = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=10)
    return VisionTransformer(**{**settings, **kwargs}).eval()


def saved(model, path):
    torch.save(model.state_dict(), path)
    return load_checkpoint(path)


def test_register_tokens_are_counted_and_the_built_model_is_the_saved_one(tmp_path):
    """A timm ViT with a class token and a register token: the model built from the tensors alone
    has both, and computes what the saved model computes."""
    model = timm_vit(reg_tokens=1)
    built = checkpoint_model(saved(model, tmp_path / "reg.pt"), heads=4)
    assert built.model.num_prefix_tokens == 2 and built.model.reg_token.shape == (1, 1, 32)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(built.model(x), model(x), rtol=0, atol=1e-6)
    assert timm_vit_kwargs(model.state_dict(), "", (4, 4))["reg_tokens"] == 1
    assert timm_vit_kwargs(timm_vit().state_dict(), "", (4, 4))["reg_tokens"] == 0


def test_what_the_tensors_do_not_tell_is_asked_for_by_name(tmp_path):
    sd = timm_vit().state_dict()
    assert rendered(timm_vit_kwargs, sd, "", None) == (
        "the checkpoint does not tell its token grid (position embedding rows 17, 1 prefix token(s)); give it with "
        "<grid>")
    assert rendered(timm_vit_kwargs, {"blocks.0.attn.qkv.weight": torch.zeros(96, 32)}, "", (4, 4)) == (
        "the checkpoint has no 2-D patch embedding (patch_embed.proj.weight [D, C, p, p]); it is not a timm "
        "VisionTransformer")
    assert rendered(checkpoint_model, saved(timm_vit(), tmp_path / "a.pt")) == (
        "the checkpoint does not tell its number of heads; give it with <heads> (it must divide dim 32), or name "
        "the timm model with <model_name>")


@pytest.fixture
def rgb(tmp_path):
    """A three-channel timm ViT checkpoint (16x16 inputs) and its built model."""
    return checkpoint_model(saved(timm_vit(img_size=16, patch_size=4, in_chans=3), tmp_path / "rgb.pt"), heads=4)


def test_a_folder_of_colour_images_keeps_each_channel_in_its_place(tmp_path, rgb):
    """RGB images of the model's own size: channel c of input i is the image's channel c, scaled to
    [0, 1] and standardized per channel over the batch (no resize, so exact)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(5, 16, 16, 3), dtype=np.uint8)
    pixels[..., 1] //= 4  # the channels differ in scale, so a mixed-up axis shows
    (tmp_path / "img").mkdir()
    for i, p in enumerate(pixels):
        Image.fromarray(p, "RGB").save(tmp_path / "img" / f"{i}.png")
    got = fit_inputs_for(str(tmp_path / "img"), rgb, samples=5)
    want = torch.from_numpy(pixels.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    want = (want - want.mean(dim=(0, 2, 3), keepdim=True)) / want.std(dim=(0, 2, 3), keepdim=True)
    torch.testing.assert_close(got.x, want, rtol=0, atol=1e-5)
    assert got.source == f"{tmp_path / 'img'}: 5 images, resized to 16x16 and standardized with their own mean and std"


def test_data_dir_beside_a_folder_or_a_tensor_file_is_refused(tmp_path, rgb):
    (tmp_path / "img").mkdir()
    torch.save(torch.zeros(2, 3, 16, 16), tmp_path / "x.pt")
    assert rendered(fit_inputs_for, str(tmp_path / "img"), rgb, 4, data_dir=tmp_path) == (
        f"<data_dir> is where a named dataset is read from; <data> is the image folder {tmp_path / 'img'}, so it "
        "would do nothing")
    assert rendered(fit_inputs_for, str(tmp_path / "x.pt"), rgb, 4, data_dir=tmp_path) == (
        f"<data_dir> is where a named dataset is read from; <data> is the tensor file {tmp_path / 'x.pt'}, so it "
        "would do nothing")


def test_a_safetensors_file_of_several_tensors_needs_one_named_inputs(tmp_path, rgb):
    from safetensors.torch import save_file

    x = torch.randn(4, 3, 16, 16)
    save_file({"a": x, "b": x.clone()}, str(tmp_path / "two.safetensors"))
    assert rendered(fit_inputs_for, str(tmp_path / "two.safetensors"), rgb, 4) == (
        f"<data> {tmp_path / 'two.safetensors'} holds 2 tensors; name the inputs 'inputs'")
    save_file({"a": x * 0, "inputs": x}, str(tmp_path / "named.safetensors"))
    torch.testing.assert_close(fit_inputs_for(str(tmp_path / "named.safetensors"), rgb, 4).x, x, rtol=0, atol=0)


@pytest.mark.slow  # transformers takes ~14 s to import
def test_a_hugging_face_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path, cli_process):
    """A ViT folder from save_pretrained whose weights file lost one LayerNorm: transformers would
    fill it with a fresh init; the model is refused, naming the tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=4, intermediate_size=64)
    ViTModel(cfg).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    assert checkpoint_model(load_checkpoint(weights)).heads == 4  # whole, it builds
    lost = next(k for k in tensors if k.endswith("layernorm.weight") and "layer." not in k)
    save_file({k: v for k, v in tensors.items() if k != lost}, str(weights), metadata={"format": "pt"})
    msg = rendered(checkpoint_model, load_checkpoint(weights))
    assert msg.startswith(f"the checkpoint's weights do not fit the ViTModel of {tmp_path / 'hf' / 'config.json'} "
                          "(tensors the checkpoint lacks: "), msg
    assert lost.split(".")[-2] in msg
    r = cli_process("apply", weights, "--out", tmp_path / "o.safetensors")  # transformers' own table stays quiet
    assert r.returncode == 2 and error_line(r.stderr) == f"error: {msg}".replace("<", "").replace(">", "")
    assert not (tmp_path / "o.safetensors").exists()
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(weights), metadata={"format": "pt"})
    assert rendered(checkpoint_model, load_checkpoint(weights)) == (
        f"the checkpoint's weights do not fit the ViTModel of {tmp_path / 'hf' / 'config.json'} (tensors the model "
        "does not have: extra.weight)")


@pytest.mark.slow  # transformers takes seconds to import
def test_hugging_face_checkpoints_of_the_same_weights_and_another_computation_get_their_own_fits(tmp_path):
    """Issue 45, silent-wrong: two ViT folders of byte-identical weights whose config.json differs
    only in hidden_act (gelu -> relu) and layer_norm_eps, sharing a cache: the second apply said "read
    from the cache" and wrote the first model's fit. Each gets the fit of its own model: the second
    is fitted, and writes what it writes with a cache of its own."""
    import json
    import shutil

    from safetensors.torch import load_file
    from transformers import ViTConfig, ViTModel

    from structinit.apply.checkpoint import apply_checkpoint

    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    ViTModel(cfg).save_pretrained(tmp_path / "gelu")
    shutil.copytree(tmp_path / "gelu", tmp_path / "relu")
    doc = json.loads((tmp_path / "relu" / "config.json").read_text())
    doc.update(hidden_act="relu", layer_norm_eps=1e-3)
    (tmp_path / "relu" / "config.json").write_text(json.dumps(doc))
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("gelu", "relu")]
    assert weights[0] == weights[1]
    fit = dict(data_fit=5, data_fit_samples=16)

    def applied(name, cache, out):
        rep = apply_checkpoint(tmp_path / name / "model.safetensors", out=tmp_path / out, cache_dir=tmp_path / cache,
                               **fit)
        return rep, load_file(tmp_path / out)

    gelu, gelu_sd = applied("gelu", "shared", "gelu.safetensors")
    relu, relu_sd = applied("relu", "shared", "relu.safetensors")
    assert gelu["data_fit"]["artifact"]["cached"] is False and relu["data_fit"]["artifact"]["cached"] is False
    assert relu["data_fit"]["artifact"]["key"] != gelu["data_fit"]["artifact"]["key"]
    alone, alone_sd = applied("relu", "own", "alone.safetensors")
    assert alone["data_fit"]["artifact"]["key"] == relu["data_fit"]["artifact"]["key"]
    q = "encoder.layer.1.attention.attention.query.weight"
    assert torch.equal(relu_sd[q], alone_sd[q]) and float((relu_sd[q] - gelu_sd[q]).abs().max()) > 1e-3
    again, _ = applied("gelu", "shared", "again.safetensors")
    assert again["data_fit"]["artifact"] == {**gelu["data_fit"]["artifact"], "cached": True}


@pytest.mark.slow  # transformers takes seconds to import
def test_a_hugging_face_folder_is_applied_into_a_folder_from_pretrained_loads(tmp_path, cli):
    """Issue 45: a save_pretrained folder was refused ("give the checkpoint file inside it"). It is
    read as its weights file, and written as DIR.impulse beside it: the written weights under the
    same name and every other file copied, which from_pretrained loads with no tensor missing. An
    existing output is refused, and with --force kept as OUT.bak."""
    import json

    from safetensors.torch import load_file
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    ViTModel(cfg).save_pretrained(tmp_path / "vit")
    (tmp_path / "vit" / "preprocessor_config.json").write_text('{"do_resize": false}')
    before = {p.name: p.read_bytes() for p in (tmp_path / "vit").iterdir()}
    fit = ["-p", "data_fit=5", "-p", "data_fit_samples=16", "--json"]
    plan = json.loads(cli("apply", tmp_path / "vit", "--dry-run", "--json").stdout)
    assert plan["output"] == str(tmp_path / "vit.impulse") and plan["weights"] == str(
        tmp_path / "vit.impulse" / "model.safetensors") and not (tmp_path / "vit.impulse").exists()
    r = cli("apply", tmp_path / "vit", *fit)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    out = tmp_path / "vit.impulse"
    assert rep["input"] == str(tmp_path / "vit") and rep["output"] == str(out) and rep["heads"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    assert (out / "config.json").read_bytes() == before["config.json"]
    model, info = ViTModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = load_file(out / "model.safetensors")
    model.save_pretrained(tmp_path / "resaved")  # what the model loaded, in the names on disk
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert sorted(resaved) == sorted(written) and all(torch.equal(resaved[k], written[k]) for k in written)
    q = "encoder.layer.1.attention.attention.query.weight"
    assert not torch.equal(written[q], load_file(tmp_path / "vit" / "model.safetensors")[q])  # the init is in it
    r = cli("apply", tmp_path / "vit" / "model.safetensors", *fit, "--out", tmp_path / "file.safetensors")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data_fit"]["artifact"] == {**rep["data_fit"]["artifact"], "cached": True}
    alone = load_file(tmp_path / "file.safetensors")
    assert all(torch.equal(alone[k], written[k]) for k in written)  # the folder's weights are the file's
    assert {p.name: p.read_bytes() for p in (tmp_path / "vit").iterdir()} == before  # the input is untouched
    r = cli("apply", tmp_path / "vit", *fit)
    assert r.returncode == 2 and error_line(r.stderr) == (
        f"error: {out} already exists (the default output name; choose another with --out); pass --force to replace "
        f"it (it is kept as vit.impulse.bak)")
    r = cli("apply", tmp_path / "vit", *fit, "--force")
    assert r.returncode == 0 and json.loads(r.stdout)["backup"] == str(tmp_path / "vit.impulse.bak")
    assert (tmp_path / "vit.impulse.bak" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    assert rep["data_fit"]["artifact"]["cached"] is False
