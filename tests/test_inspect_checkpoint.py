"""inspect takes what apply takes and reports apply's measure under apply's name (issue 52): a
Hugging Face folder, ``--model``; the attention through the model on the noise inputs apply's fit
runs on, equal to what apply printed for the checkpoint it wrote, beside the position-embedding
measure, each labelled."""

import json

import pytest
import torch
from conftest import error_line, says, vit_digits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_inspect_measures_an_applied_checkpoint_as_apply_did(tmp_path, cli):
    torch.save(vit_digits(pos_embed="learned").state_dict(), tmp_path / "stock.pt")
    r = cli("apply", tmp_path / "stock.pt", "--heads", "4", "-p", "data_fit=20", "--out", tmp_path / "o.pt",
            "--json")
    assert r.returncode == 0, r.stderr
    applied = json.loads(r.stdout)
    r = cli("inspect", tmp_path / "o.pt", "--heads", "4", "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["measured_on"] == "pos_embed (sincos), LayerNorm'd"  # the first measure, labelled
    on = seen["on_inputs"]
    assert on["inputs"].startswith("64 Gaussian noise inputs N(0, 1) of shape [1, 8, 8] (seed 0), through timm")
    fitted = applied["data_fit"]["layers"]
    assert applied["data_fit"]["measured_on"] == 64
    for mine, theirs in zip(on["layers"], fitted):
        assert mine["hit_rate"] == pytest.approx(theirs["hit_rate"], abs=1e-6)
        assert mine["target_mass"] == pytest.approx(theirs["target_mass"], abs=1e-5)
    text = cli("inspect", tmp_path / "o.pt", "--heads", "4").stdout
    assert "(as apply measures it), against the same offsets, per layer: hit rate " in text
    assert "attention on pos_embed (sincos), LayerNorm'd, against each head's closest impulse offset:" in text


def test_inspect_takes_a_hugging_face_folder_and_a_timm_model_name(tmp_path, cli):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64)
    ViTModel(cfg).save_pretrained(tmp_path / "hf")
    r = cli("inspect", tmp_path / "hf", "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["layout"] == "hf-vit" and seen["heads"] == 4 and seen["grid"] == [4, 4]
    assert seen["on_inputs"] is None and seen["on_inputs_skipped"]  # said, not silent
    text = cli("inspect", tmp_path / "hf").stdout
    assert "attention through the model not measured: " in text
    (tmp_path / "plain").mkdir()
    r = cli("inspect", tmp_path / "plain")
    assert r.returncode == 2 and says(error_line(r.stderr), "not a Hugging Face model's", "config.json")
    import timm

    torch.save(timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10).state_dict(), tmp_path / "t.pt")
    r = cli("inspect", tmp_path / "t.pt", "--model", "vit_tiny_patch16_224", "--grid", "2x2", "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["heads"] == 3 and seen["on_inputs"]["inputs"].startswith("64 Gaussian noise inputs N(0, 1) of "
                                                                          "shape [3, 32, 32]")
    r = cli("inspect", tmp_path / "t.pt", "--model", "")
    assert r.returncode == 2
    assert says(error_line(r.stderr), "--model", "empty")
    r = cli("inspect", tmp_path / "t.pt", "--model", "vit_tiny_patch16_224", "--data", "digits")
    assert r.returncode == 2 and "--model" in error_line(r.stderr)
