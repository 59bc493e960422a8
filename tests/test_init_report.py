"""The init report as a typed contract (:class:`structinit.init.report.InitReport`): every built-in
method's report keeps the JSON layout it had before it was typed (``tests/init_report_layouts.json``,
written by main before the change), reads back from that layout with every field's type checked,
and holds the impulse structure as fields; a spec class is refused at registration when it fits
data without a ``without_fit`` or when its ``has_base`` does not say whether it has a ``base``."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
from test_init_conformance import QUICK, images, tiny_vit

from structinit.errors import StructinitWarning
from structinit.init.base import REGISTERED, InitSpec, register
from structinit.init.initialize import initialize, initialize_model
from structinit.init.registry import BUILTIN_MODULES, INIT_METHODS, init_spec
from structinit.init.report import FitRecord, InitReport, LayerRow, StructureRecord

LAYOUTS = json.loads((Path(__file__).parent / "init_report_layouts.json").read_text())["reports"]
#: Values that differ from run to run (time, where the cache is, whether it held the artifact).
VARYING = {"seconds", "path", "cached"}


def same_layout(old, new, where="report"):
    """``(where, what)`` of the first difference between two JSON values: the same keys in the same
    order, the same strings and flags, numbers within 1e-5 (``VARYING`` values skipped)."""
    if isinstance(old, dict):
        if not isinstance(new, dict) or list(old) != list(new):
            return where, f"keys {list(old)} != {list(new) if isinstance(new, dict) else new!r}"
        for key in old:
            if key not in VARYING:
                diff = same_layout(old[key], new[key], f"{where}.{key}")
                if diff:
                    return diff
        return None
    if isinstance(old, list):
        if not isinstance(new, list) or len(old) != len(new):
            return where, f"{old!r} != {new!r}"
        return next((d for d in (same_layout(o, n, f"{where}[{i}]") for i, (o, n) in enumerate(zip(old, new)))
                     if d), None)
    if isinstance(old, float) and not isinstance(old, bool):
        ok = isinstance(new, (int, float)) and abs(old - new) <= 1e-5 * max(1.0, abs(old))
        return None if ok else (where, f"{old!r} != {new!r}")
    return None if (old == new and type(old) is type(new)) else (where, f"{old!r} != {new!r}")


def report_of(name, tmp_path):
    """``initialize``'s report of the case ``name`` of ``LAYOUTS`` ("METHOD[ data_fit=0] model|state_dict"),
    made as it was made there."""
    words = name.split()
    method, target = words[0], words[-1]
    params = {"data_fit": 0} if "data_fit=0" in words else QUICK.get(method, {})
    spec = init_spec(method, **params)
    model = tiny_vit()
    on = model if target == "model" else {k: v.clone() for k, v in model.state_dict().items()}
    data = images() if spec.uses_data and target == "model" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructinitWarning)
        return initialize(on, spec, seed=3, cache_dir=tmp_path, data=data, heads=None if target == "model" else 2)


def test_the_recorded_layouts_cover_every_built_in_method():
    built_in = {name for name, cls in INIT_METHODS.items() if cls.__module__ in {m.__name__ for m in BUILTIN_MODULES}}
    assert {name.split()[0] for name in LAYOUTS} == built_in


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_to_dict_is_the_layout_the_report_had_before_it_was_typed(name, tmp_path):
    report = report_of(name, tmp_path)
    assert isinstance(report, InitReport)
    assert same_layout(LAYOUTS[name], report.to_dict()) is None
    assert same_layout(LAYOUTS[name], json.loads(json.dumps(report.to_dict()))) is None  # JSON-able as it is
    again = InitReport.from_dict(json.loads(json.dumps(report.to_dict())))  # a run folder's config.json, read
    assert again.to_dict() == json.loads(json.dumps(report.to_dict())) and again.structure == report.structure


def test_impulse_report_holds_its_structure_as_fields(tmp_path):
    report = initialize_model(tiny_vit(), "impulse", seed=3, cache_dir=tmp_path, data=images(), **QUICK["impulse"])
    s = report.structure
    assert isinstance(s, StructureRecord) and s.grid == [4, 4] and s.padding == "zero" and s.filter == 3
    assert s.causal is False and s.artifact == report.to_dict()["artifact"]["key"]
    assert s.offsets == {row.layer: row.offsets for row in report.layers} and sorted(s.offsets) == [0, 1]
    assert all(len(o) == 2 for o in s.offsets.values())  # a [dy, dx] per head
    fit = report.fit
    assert isinstance(fit, FitRecord) and fit.inputs == "data" and fit.samples == 16 and report.fit_ran
    assert fit.version == 2 and fit.layers and fit.measured_count == fit.measured_on
    assert [row.hit_rate for row in report.layers] == [r["hit_rate"] for r in report["layers"]]  # the mapping view
    assert report.changed and report.changed == report["changed"]
    assert initialize_model(tiny_vit(), "mimetic").structure is None  # no offsets: no structure


def test_from_dict_names_the_field_of_the_wrong_type():
    with pytest.raises(ValueError, match=r"LayerRow.layer must be .*int.*got '0'"):
        InitReport.from_dict({"method": "x", "layers": [{"layer": "0", "replaced": []}]})
    with pytest.raises(ValueError, match=r"InitReport.changed must be .*got 'a.weight'"):
        InitReport.from_dict({"method": "x", "changed": "a.weight"})
    with pytest.raises(ValueError, match="FitRecord.samples"):
        InitReport.from_dict({"method": "x", "data_fit": {"samples": True}})
    with pytest.raises(ValueError, match="InitReport needs method"):
        InitReport.from_dict({"layers": []})
    with pytest.raises(ValueError, match="JSON object"):
        InitReport.from_dict([1, 2])


def test_a_report_built_from_fields_writes_the_set_ones_and_its_extra():
    report = InitReport("toy", layers=[LayerRow(0, replaced=["q"])], extra={"self_mass": 0.5})
    assert report.to_dict() == {"method": "toy", "layers": [{"layer": 0, "replaced": ["q"]}], "self_mass": 0.5}
    report.changed, report.fit = [], FitRecord(skipped="not run")
    assert report.to_dict()["changed"] == [] and report.to_dict()["data_fit"] == {"skipped": "not run"}
    assert report.holds("fit") and not report.fit_ran and not InitReport("toy").holds("fit")
    off = InitReport.from_dict({"method": "toy", "data_fit": None})  # a method whose fit is off says so
    assert off.holds("fit") and off.to_dict() == {"method": "toy", "data_fit": None}


def _spec_class(name, **body):
    return dataclasses.make_dataclass(name, list(body.pop("fields", [])), bases=(InitSpec,), frozen=True,
                                      namespace={"method": name.lower(), "writes": "nothing", **body})


def test_register_refuses_a_fitting_method_without_without_fit_and_an_undeclared_base():
    saved = dict(REGISTERED)
    try:
        with pytest.raises(TypeError, match="Fitter fits data .* does not override without_fit"):
            register(_spec_class("Fitter", fits_data=True))
        with pytest.raises(TypeError, match="Based has base parameter but declares has_base = False"):
            register(_spec_class("Based", fields=[("base", str, dataclasses.field(default="model"))]))
        with pytest.raises(TypeError, match="Baseless has no base parameter but declares has_base = True"):
            register(_spec_class("Baseless", has_base=True))
        base = [("base", str, dataclasses.field(default="model"))]
        ok = register(_spec_class("Declared", has_base=True, fields=base))
        assert REGISTERED["declared"] is ok and ok().other_weights == "model"
        assert ok(base="pytorch").other_weights == "pytorch"
    finally:
        REGISTERED.clear()
        REGISTERED.update(saved)
    assert {"fitter", "based", "baseless", "declared"}.isdisjoint(REGISTERED)


def test_base_and_causal_are_read_from_the_declarations():
    """``train`` gives its base to a method that declares one, ``apply`` refuses any base but model,
    ``train`` refuses causal offsets: each from the spec's declaration, never its fields."""
    from structinit.apply.options import ApplyOptions
    from structinit.errors import UsageError
    from structinit.training.config import TrainConfig

    declared = sorted(name for name, cls in INIT_METHODS.items() if cls.has_base)
    assert declared == ["conditioned", "impulse", "mimetic"]
    for name in INIT_METHODS:
        spec = TrainConfig(init=name).init
        assert (spec.params().get("base") == "pytorch-mlp") == INIT_METHODS[name].has_base
    with pytest.raises(UsageError, match="base"):
        ApplyOptions().check(init_spec("mimetic", base="pytorch"))
    ApplyOptions().check(init_spec("kaiming"))  # no base to refuse
    assert init_spec("impulse", causal=True).is_causal() and not init_spec("impulse").is_causal()
    assert not any(init_spec(name).is_causal() for name in INIT_METHODS if name != "impulse")
    with pytest.raises(UsageError, match="causal"):
        TrainConfig(init="impulse", init_params={"causal": True}, dataset="digits", model="vit-digits").validate()


def _solved(**over):
    """A report's JSON layout with impulse offsets in two layers and its artifact's solve settings."""
    d = {"method": "impulse", "grid": [4, 4],
         "layers": [{"layer": 0, "offsets": [[0, 1], [1, 0]]}, {"layer": 1, "offsets": [[-1, 0], [0, -1]]}],
         "artifact": {"key": "abc123", "config": {"padding": "circular", "causal": True, "filter": 5}}}
    d.update(over)
    return d


def test_the_structure_is_read_from_the_artifacts_solve_settings_or_the_report_itself():
    s = InitReport.from_dict(_solved()).structure
    assert s == StructureRecord(grid=[4, 4], offsets={0: [[0, 1], [1, 0]], 1: [[-1, 0], [0, -1]]},
                                padding="circular", filter=5, causal=True, artifact="abc123")
    bare = InitReport.from_dict(_solved(artifact=None)).structure  # impulse-2025: no artifact, no settings given
    assert (bare.padding, bare.filter, bare.causal, bare.artifact) == ("zero", None, False, None)
    own = InitReport.from_dict(_solved(artifact=None, padding="reflect", causal=True, filter=3)).structure
    assert (own.padding, own.filter, own.causal) == ("reflect", 3, True)


def test_no_structure_without_offsets_in_every_layer_and_a_grid():
    partial = _solved(layers=[{"layer": 0, "offsets": [[0, 1], [1, 0]]}, {"layer": 1}])
    assert InitReport.from_dict(partial).structure is None  # one layer without offsets
    assert InitReport.from_dict(_solved(grid=None)).structure is None
    assert InitReport.from_dict(_solved(layers=[])).structure is None


def test_reports_are_equal_when_their_layouts_are():
    a, b = InitReport.from_dict(_solved()), InitReport.from_dict(_solved())
    assert a == b and a == _solved()  # a report, or the dict code was written against
    assert a != InitReport.from_dict(_solved(method="impulse-2025"))  # the same structure, another layout
    plain = InitReport.from_dict({"method": "mimetic", "layers": [{"layer": 0}]})
    assert plain != InitReport.from_dict({"method": "kaiming", "layers": [{"layer": 0}]})  # neither has structure


def test_a_line_of_values_per_layer_and_their_mean():
    from structinit.init.report import layers_line

    assert layers_line("hit rate", [0.9, None, 0.6]) == "hit rate 0.90 0.60 (mean 0.75)"
    assert layers_line("hit rate", [None, None]) == ""
