"""The weak-structure warning follows the project's measurements (issue 52): it fires only where a
layer is weak AND a remedy was measured to structure that class of shape (a token's content filling
the stream), never where the whole-stream fit was measured to win (a token of few values: digits,
32x32 images in 2x2 patches); its remedies come in order of measured effect, each with what it did
and where, in the caller's syntax; and docs/init-methods.md shows the table the advice comes from."""

import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from conftest import digits_images, error_line, filling_images, vit_digits, vit_filling

from structinit.cli.common import CommandSyntax
from structinit.errors import StructinitWarning, Syntax
from structinit.experiments.task import GridSyntax
from structinit.fit.advice import SHAPE_CLASSES, STRUCTURE_FLOOR, advice_table, shape_class, structure_warning
from structinit.init.initialize import initialize_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "init-methods.md"


def _weak(model, **params):
    """The weak-structure warnings of a one-step fit (one step leaves every layer weak)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = initialize_model(model, "impulse", data_fit=1, seed=0, **params)
    weak = [w.message for w in seen if isinstance(w.message, StructinitWarning)
            and "the data fit left layer" in str(w.message)]
    return report, weak


def _report(token_values, dim, *hits, inputs="noise", subspace=False):
    out = {"dim": dim, "data_fit": {"inputs": inputs, "token_values": token_values,
                                    "layers": [{"layer": i, "hit_rate": h} for i, h in enumerate(hits)]}}
    if subspace:
        out["position_subspace"] = {"dims": 4}
    return out


def test_a_shape_is_classed_by_its_tokens_values_against_the_stream():
    few, between, fills = SHAPE_CLASSES
    assert shape_class(1, 64) is few and shape_class(12, 192) is few  # digits; ViT-T on 32x32 in 2x2 patches
    assert shape_class(16, 64) is few and shape_class(17, 64) is between  # a quarter is the last of "few"
    assert shape_class(47, 48) is between and shape_class(48, 48) is fills and shape_class(49, 48) is fills
    assert shape_class(768, 192) is fills  # ViT-T at 16x16x3 patches
    assert shape_class(None, 64) is None and shape_class(16, None) is None  # token ids: not classed
    assert few.remedies == () and between.remedies == ()  # nothing measured to help there
    assert [r.name for r in fills.remedies] == ["position_subspace", "data"]  # by measured effect
    assert few.holds(Fraction(1, 4)) and not few.holds(Fraction(1, 3))


def test_the_warning_fires_only_where_a_measured_remedy_helps():
    weak = (0.97, 0.93, 0.89, 0.87)  # the stock digits model's fit on noise (seed 0), the case
    assert structure_warning(_report(1, 64, *weak)) is None  # the whole-stream fit wins there
    assert structure_warning(_report(12, 192, *weak)) is None  # ViT-T at 32x32 in 2x2 patches
    assert structure_warning(_report(32, 64, *weak)) is None  # not measured: no advice
    assert structure_warning(_report(None, 64, *weak)) is None
    assert structure_warning(_report(768, 192, 0.95, STRUCTURE_FLOOR)) is None  # at the floor is structured
    text = Syntax()  # Python's syntax
    said = StructinitWarning(structure_warning(_report(768, 192, 0.45, 0.01))).render(text)
    assert said.startswith("the data fit left layer 1 hitting its offsets in 0.01 of the rows on its noise inputs "
                           "(2 layers below 0.9; per layer 0.45 0.01): a token's 768 values fill the stream of 192")
    first, then = said.split("for structure try ")[1].split("; then ")
    assert first.startswith("position_subspace=True (0.96-1.00 per layer held out") and "docs/results/patch16" in first
    assert "-0.72 ± 0.36 points against mimetic" in first  # its measured cost, beside its gain
    assert "+0.52 ± 0.22 with flips alone" in first  # and where the cost is the recipe's crops
    assert then.startswith("real inputs (data) (mean 0.18 -> 0.36")
    # what the fit used already is not advised again; nothing left, nothing said
    on_data = StructinitWarning(structure_warning(_report(768, 192, 0.5, inputs="data"))).render(text)
    assert "real inputs" not in on_data and "position_subspace=True" in on_data
    in_sub = StructinitWarning(structure_warning(_report(768, 192, 0.5, subspace=True))).render(text)
    assert "position_subspace" not in in_sub.split("for structure try ")[1] and "real inputs (data)" in in_sub
    assert structure_warning(_report(768, 192, 0.5, inputs="data", subspace=True)) is None


def test_the_advice_is_written_in_the_callers_syntax():
    message = StructinitWarning(structure_warning(_report(768, 192, 0.5)))
    apply_cli = CommandSyntax(["--data", "--init-param", "--data-fit"])
    assert "try -p position_subspace=true (" in message.render(apply_cli)
    assert "; then real inputs (--data) (" in message.render(apply_cli)
    assert "try init_params.position_subspace = true (" in message.render(GridSyntax())
    assert "try position_subspace=True (" in message.render()
    # a command's own flag is written as a flag with its value; a switch as itself
    from structinit.errors import setting

    assert StructinitWarning(setting("data_fit", 1000)).render(apply_cli) == "--data-fit 1000"
    assert StructinitWarning(setting("mimetic_vproj", False)).render(CommandSyntax(["--mimetic-vproj"])) == \
        "--no-mimetic-vproj"
    assert StructinitWarning(setting("set_pe", "sincos")).render(CommandSyntax(["--init-param"])) == "-p set_pe=sincos"
    assert StructinitWarning(setting("set_pe", "sincos")).render() == "set_pe='sincos'"


def test_the_docs_table_is_the_table_the_advice_comes_from():
    text = DOCS.read_text()
    start, end = "<!-- advice-table:start -->\n", "\n<!-- advice-table:end -->"
    assert start in text and end in text
    assert text.split(start)[1].split(end)[0] == advice_table()
    for c in SHAPE_CLASSES:
        assert c.name in advice_table()


def test_no_warning_on_the_digits_shape_and_one_where_content_fills_the_stream():
    """Real models and fits: one step leaves every layer weak in both, and only the filling one warns."""
    report, weak = _weak(vit_digits(), data=digits_images(16))
    assert max(r["hit_rate"] for r in report["data_fit"]["layers"]) < STRUCTURE_FLOOR and weak == []
    assert report["data_fit"]["token_values"] == 1
    report, weak = _weak(vit_filling(), data=filling_images(16))
    assert report["data_fit"]["token_values"] == 16 and report["dim"] == 16
    assert len(weak) == 1 and "for structure try position_subspace=True (" in weak[0].render()
    assert "real inputs" not in weak[0].render()  # the fit ran on real inputs


def test_a_vit_t_at_32x32_in_2x2_patches_gets_no_warning():
    """The paper's CIFAR shape (12 values a token into 192): a weak layer there is not warned about."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=2, depth=2, num_classes=10)
    report, weak = _weak(model, data_fit_samples=4)
    assert report["data_fit"]["token_values"] == 12 and weak == []


@pytest.mark.slow
def test_apply_on_a_stock_vit_t16_warns_with_the_subspace_as_a_flag_first(tmp_path, cli):
    import timm

    torch.save(timm.create_model("vit_tiny_patch16_224", num_classes=10).state_dict(), tmp_path / "vt.pt")
    r = cli("apply", tmp_path / "vt.pt", "--model", "vit_tiny_patch16_224", "-p", "data_fit=1",
            "-p", "data_fit_samples=2", "--out", tmp_path / "o.pt")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1, r.stderr
    assert "a token's 768 values fill the stream of 192" in lines[0]
    assert lines[0].split("for structure try ")[1].startswith("-p position_subspace=true (")
    assert "; then real inputs (--data) (" in lines[0]


@pytest.mark.slow
def test_apply_on_a_stock_digits_checkpoint_gives_no_warning(tmp_path, cli):
    from structinit.training.models import ModelConfig, build_model

    stock = build_model(ModelConfig("vit-digits", pos_embed="learned"), num_classes=10, image_size=8, in_chans=1,
                        seed=0)
    torch.save(stock.state_dict(), tmp_path / "stock.pt")
    r = cli("apply", tmp_path / "stock.pt", "--heads", "4", "--out", tmp_path / "o.pt")
    assert r.returncode == 0, r.stderr
    assert "warning:" not in r.stderr and "position_subspace" not in r.stderr
    r = cli("apply", tmp_path / "stock.pt", "--heads", "4", "--out", tmp_path / "bad.pt", "-p", "data_fit=-1")
    assert r.returncode == 2 and error_line(r.stderr).startswith("error: ")


def test_a_fitted_artifacts_record_is_advised_as_the_init_was():
    """inspect's advice for a fitted artifact reads its identity: the noise inputs' shape classes the
    shape; a fit in the subspace is not advised the subspace; a fit on a batch, whose shape the
    record does not keep, and a shape where the whole-stream fit wins get nothing."""
    from structinit.fit.advice import fitted_structure_warning

    layers = [{"layer": 0, "hit_rate": 0.5}, {"layer": 1, "hit_rate": 0.95}]

    def record(fit=None, inputs=None, **ident):
        return {"identity": {"fit": fit or {}, **({"inputs": inputs} if inputs else {}), **ident},
                "report": {"layers": layers}}

    noise = {"kind": "noise", "seed": 0, "samples": 16, "shape": [3, 64, 64]}
    text = StructinitWarning(fitted_structure_warning(record({"data_fit": 300}, noise), (4, 4), 192)).render()
    assert text.startswith("the data fit left layer 0 hitting its offsets in 0.50 of the rows on its noise inputs:")
    assert "a token's 768 values fill the stream of 192" in text
    assert "try position_subspace=True (" in text and "; then real inputs (data) (" in text
    sub = StructinitWarning(fitted_structure_warning(record({"position_dims": 48}, noise), (4, 4), 192)).render()
    assert "position_subspace" not in sub.split("try ")[1] and "try real inputs (data) (" in sub
    assert fitted_structure_warning(record(batch="sha256:0", samples=16), (4, 4), 192) is None  # shape not kept
    few = {"kind": "noise", "seed": 0, "samples": 16, "shape": [1, 8, 8]}
    assert fitted_structure_warning(record({}, few), (8, 8), 64) is None  # 1 value a token into 64
    assert fitted_structure_warning({"report": {"layers": layers}}, (4, 4), 192) is None
