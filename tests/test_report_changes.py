"""A report names everything an init wrote (issue 52): for every registered method and every
checkpoint layout it takes, apply's output file is diffed against its input, tensor by tensor, and
the report's ``changed`` must name exactly the tensors that differ; ``initialize_model`` likewise
on a model. The names come from the tensors, so the position subspace's projected writers (the
patch embedding, the class token, every block's output projections) are named too, and the text
report says how many tensors changed and which."""

import warnings

import pytest
import torch
from safetensors.torch import load_file
from test_apply_sequence_models import bert, gpt2
from test_init_conformance import QUICK
from test_injection import hf_state_dict, tiny_vit

from structinit.apply.checkpoint import apply_checkpoint
from structinit.errors import StructinitError
from structinit.init.changes import changed, snapshot
from structinit.init.initialize import initialize_model
from structinit.init.registry import INIT_METHODS

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore")]
PARAMS = {**QUICK, "impulse": {"data_fit": 2, "data_fit_samples": 4}}


def _layouts(tmp_path):
    """Checkpoint files of every layout apply reads, with the heads apply must be told."""
    files = {}
    torch.save(tiny_vit(depth=2).state_dict(), tmp_path / "timm.pt")
    files["timm-vit"] = (tmp_path / "timm.pt", 4)
    torch.save({"state_dict": tiny_vit(depth=2, class_token=True).state_dict(), "epoch": 3}, tmp_path / "timm-cls.pth")
    files["timm-vit, train.py's wrapping, class token"] = (tmp_path / "timm-cls.pth", 4)
    torch.save(hf_state_dict(depth=2), tmp_path / "hf.pt")
    files["hf-vit"] = (tmp_path / "hf.pt", 4)
    torch.save(bert().state_dict(), tmp_path / "bert.pt")
    files["bert"] = (tmp_path / "bert.pt", 4)
    torch.save(gpt2().state_dict(), tmp_path / "gpt2.pt")
    files["gpt2"] = (tmp_path / "gpt2.pt", 4)
    torch.save(torch.nn.MultiheadAttention(32, 4).state_dict(), tmp_path / "mha.pt")
    files["mha"] = (tmp_path / "mha.pt", 4)
    return files


def _flat(obj, where=()):
    """Every tensor of a loaded checkpoint by the name of its state dict, as the report keys them."""
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {".".join(where) or "(top level)": obj}
    out = {}
    for k, v in (obj.items() if isinstance(obj, dict) else ()):
        if isinstance(v, dict):
            out.update(_flat(v, (*where, k)))
    return out


def _load(path):
    return load_file(str(path)) if str(path).endswith(".safetensors") else torch.load(path, weights_only=True)


@pytest.mark.parametrize("method", sorted(INIT_METHODS))
def test_apply_names_every_tensor_it_changed_for_every_method_and_layout(method, tmp_path):
    taken = 0
    for name, (path, heads) in _layouts(tmp_path).items():
        out = tmp_path / f"{path.stem}.{method}{path.suffix}"
        settings = {"heads": heads} if heads else {}
        if name in ("hf-vit", "mha", "bert", "gpt2"):
            settings["grid"] = {"hf-vit": (4, 4), "mha": (4, 4), "bert": (24,), "gpt2": (24,)}[name]
        try:
            report = apply_checkpoint(path, method, out=out, **settings, **PARAMS.get(method, {}))
        except StructinitError as exc:  # a method that cannot take this layout says so, and writes nothing
            assert not out.exists(), (name, exc)
            continue
        taken += 1
        before, after = _flat(_load(path)), _flat(_load(out))
        assert set(report["changed"]) == set(after), name
        for where, sd in after.items():
            want = changed(before[where], sd)
            assert report["changed"][where] == want, (name, where)
        assert any(report["changed"].values()), name  # an init that wrote nothing would be a bug
    assert taken >= 1


def test_apply_with_the_position_subspace_names_the_writers_it_projected(tmp_path, cli):
    """The issue's case: the subspace changes the embedding, the class token and every block's output
    projections besides Q/K, V/proj and the position embedding; the report and its text name them all."""
    torch.save(tiny_vit(depth=2, class_token=True).state_dict(), tmp_path / "v.pt")
    r = cli("apply", tmp_path / "v.pt", "--heads", "4", "-p", "position_subspace=true", "-p", "data_fit=2",
            "-p", "data_fit_samples=4", "--out", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    import json

    report = json.loads(r.stdout)
    want = changed(torch.load(tmp_path / "v.pt"), torch.load(tmp_path / "o.pt"))
    assert report["changed"] == {"(top level)": want}
    for name in ("pos_embed", "cls_token", "patch_embed.proj.weight", "blocks.1.mlp.fc2.weight",
                 "blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight"):
        assert name in want
    text = cli("apply", tmp_path / "v.pt", "--heads", "4", "-p", "position_subspace=true", "-p", "data_fit=2",
               "-p", "data_fit_samples=4", "--out", tmp_path / "o2.pt")
    assert text.returncode == 0, text.stderr
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("  tensors changed"))
    assert line.startswith(f"  tensors changed: {len(want)} (")
    assert "patch_embed.proj.weight" in line and "blocks.{0-1}.mlp.fc2.weight" in line


@pytest.mark.parametrize("method", sorted(INIT_METHODS))
def test_initialize_model_names_every_tensor_it_changed(method):
    model = tiny_vit(depth=2)
    before = snapshot(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report = initialize_model(model, method, **PARAMS.get(method, {}))
        except StructinitError:
            pytest.skip(f"{method} does not take this model")
    assert report["changed"] == changed(before, model.state_dict()) and report["changed"]


def test_an_apply_on_a_sequence_model_prints_the_structure_it_wrote(tmp_path, cli):
    """Issue 52: apply on GPT-2 (no data: the fit cannot run on token ids) printed no structure line."""
    torch.save(gpt2().state_dict(), tmp_path / "gpt2.pt")
    r = cli("apply", tmp_path / "gpt2.pt", "--heads", "4", "--causal", "--set-pe", "sincos", "--out", tmp_path / "g.pt")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("  attention on the position embedding alone: "))
    assert line.startswith("  attention on the position embedding alone: hit rate 1.00 1.00")
    assert "  tensors changed: 7 (transformer.wpe.weight, transformer.h.{0-1}.attn.c_attn.weight" in r.stdout
