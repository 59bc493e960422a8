"""Every registered init method behind one interface (:class:`structinit.init.base.InitSpec`),
checked the same way, as timm tests every model it registers: the spec round-trips through its
text, its two steps make what ``apply`` makes, its hooks answer, and copies of a model get the same
weights. No code outside a method's own modules asks which method it runs (read from the source).
And a method that fits to data, added in a module of its own (``tests/example_init.py``), goes
through ``initialize_model``, ``structinit train`` and ``structinit apply`` by its name alone."""

import ast
import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_line, says

from structinit.errors import StructinitWarning, UsageError
from structinit.init.attention_target import AttentionTarget
from structinit.init.base import REGISTERED, InitSpec, InitWarning
from structinit.init.baselines import BASES
from structinit.init.initialize import initialize, initialize_model
from structinit.init.registry import BUILTIN_MODULES, INIT_METHODS, fitting_methods, init_spec, spec_from_dict
from structinit.init.report import InitReport, LayerRow

PACKAGE = Path(__file__).resolve().parents[1] / "structinit"
#: Cheaper settings for methods whose defaults take long on the tiny model (every check holds for
#: any settings; a method not named here is checked at its defaults).
QUICK = {"impulse": {"data_fit": 20, "data_fit_samples": 16}, "impulse-2024": {"recipe_params": {"iters": 200}},
         "mixed": {"lower_params": {"data_fit": 20, "data_fit_samples": 16}}}


def tiny_vit(seed=0):
    """A timm ViT of an 4x4 grid (8x8 images, 2x2 patches), two layers 32 wide with two heads, the
    sin-cos table as its position embedding."""
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                              class_token=False, global_pool="avg", num_classes=10)
    set_sincos_pos_embed(model)
    return model


def images(n=16, seed=1):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def state(model_or_sd):
    sd = model_or_sd.state_dict() if hasattr(model_or_sd, "state_dict") else model_or_sd
    return {k: v.detach().clone() for k, v in sd.items()}


def check_method(cls, cache_dir, params=None):
    """What every registered init method does (see the module docstring)."""
    assert REGISTERED[cls.method] is cls and INIT_METHODS[cls.method] is cls
    assert cls.writes and cls.__doc__
    spec = init_spec(cls.method, **(params or {}))
    assert type(spec) is cls
    assert spec_from_dict(json.loads(spec.canonical_json())) == spec
    assert json.loads(spec.canonical_json())["method"] == cls.method
    assert spec.other_weights in BASES and cls.fixed_base in BASES
    rest = spec.without_fit()
    assert type(rest) is cls and rest.without_fit() == rest and (not rest.uses_data or not rest.fit_off())
    assert spec.uses_data == (spec.fit_samples > 0) and (spec.fit_off() == "") == (spec.uses_data or not cls.fits_data)

    data = images() if spec.uses_data else None
    a, b = tiny_vit(), tiny_vit()
    before = state(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructinitWarning)
        report = initialize(a, spec, seed=3, cache_dir=cache_dir, data=data)
    t = AttentionTarget(b, need_grid=spec.needs_grid)
    spec.check_target(t)
    prepared = spec.prepare(t, seed=3, cache_dir=cache_dir, data=data)
    written = spec.write(t, prepared, seed=3, cache_dir=cache_dir)
    after_a, after_b = state(a), state(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a), "prepare then write differs from apply"
    assert any(not torch.equal(before[k], after_a[k]) for k in before), "the init wrote nothing"
    for rep in (report, written):
        assert isinstance(rep, InitReport) and rep.method == cls.method
        rep.check()  # every field (the layer rows and the fit too) of its declared type
        assert all(isinstance(row, LayerRow) for row in rep.layers) and isinstance(rep.extra, dict)
        layout = json.loads(json.dumps(rep.to_dict()))  # JSON-able as it is, and read back the same
        assert InitReport.from_dict(layout).to_dict() == layout and layout["method"] == cls.method
    # changed: every tensor whose values the init changed, and nothing else, in the state dict's order
    assert report.changed and report.changed == [k for k in before if not torch.equal(before[k], after_a[k])]
    assert written.changed is None  # write alone compares nothing
    if cls.reports_offsets:
        assert report.structure is not None and report.structure.grid == list(t.grid)
        assert sorted(report.structure.offsets) == [row.layer for row in report.layers] == list(t.layers)

    assert all(isinstance(w, InitWarning) and isinstance(w.text, str) for w in spec.warnings(report, t))
    assert all(isinstance(w, InitWarning) for w in spec.warnings(report, t, checkpoint=True, pe_scale=1.0))
    assert all(isinstance(n, str) for n in spec.notes(report))
    shape = (t.grid, t.dim, t.heads, t.depth)
    spec.check_shape(*shape, seed=3)
    for config in spec.presolves(lambda: shape, seed=3):
        assert (tuple(config.grid), config.dim, config.heads) == (tuple(t.grid), t.dim, t.heads)
    assert isinstance(spec.replaces_pos_embed(t), bool)
    spec.check_pos_embed(t)  # the sin-cos table every method can use

    copies = [state(before) for _ in range(2)]
    views = [AttentionTarget(sd, t.grid, t.heads, need_grid=spec.needs_grid) for sd in copies]
    try:
        spec.check_target(views[0])
    except UsageError:
        return  # a method that needs the model itself (its own refusal): no copies in a file to write
    for view in views:
        spec.write_copy(view, prepared, first=False, seed=3, cache_dir=cache_dir)
    assert all(torch.equal(copies[0][k], copies[1][k]) for k in copies[0]), "two copies got different weights"


@pytest.mark.parametrize("method", list(INIT_METHODS))
def test_every_registered_method_keeps_the_interface(method, tmp_path):
    check_method(INIT_METHODS[method], tmp_path, QUICK.get(method))


def test_every_data_fitting_method_states_its_without_fit():
    """A resumed run re-applies ``without_fit()``: a method that fits data and kept the default (the
    spec itself) would fit again, on noise (``register`` refuses it; this holds the registry to it)."""
    fitting = [cls for cls in INIT_METHODS.values() if cls.fits_data]
    assert fitting and all(cls.without_fit is not InitSpec.without_fit for cls in fitting)
    for cls in fitting:
        rest = init_spec(cls.method).without_fit()
        assert not rest.uses_data and rest.fit_off()


def own_values_through_apply(method, tmp_path, params=None):
    """``(init report, apply's report)`` of ``method`` on the same tiny ViT: initialized as apply
    writes it (a state dict; the model for a method that :attr:`needs_model`), and a checkpoint of it."""
    from structinit.apply.checkpoint import apply_checkpoint

    torch.save(tiny_vit().state_dict(), tmp_path / "vit.pth")
    target = tiny_vit() if INIT_METHODS[method].needs_model else tiny_vit().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructinitWarning)
        report = initialize(target, method, seed=0, heads=2, cache_dir=tmp_path / "cache", **(params or {}))
        applied = apply_checkpoint(tmp_path / "vit.pth", method, heads=2, out=tmp_path / "out.pth",
                                   cache_dir=tmp_path / "cache", **(params or {}))
    return report, json.loads(json.dumps(applied))


@pytest.mark.parametrize("method", list(INIT_METHODS))
def test_every_methods_own_values_survive_applys_report(method, tmp_path):
    report, applied = own_values_through_apply(method, tmp_path, QUICK.get(method))
    assert applied["method"] == method and set(report.extra) <= set(applied)
    assert [row["layer"] for row in applied["layers"]] == [row.layer for row in report.layers]


def builtin_ranks() -> list:
    """Each registered method's place in ``BUILTIN_MODULES`` (its module's index; after them all for
    a method registered elsewhere), in the registry's order."""
    modules = [m.__name__ for m in BUILTIN_MODULES]
    return [modules.index(cls.__module__) if cls.__module__ in modules else len(modules)
            for cls in INIT_METHODS.values()]


def test_the_built_in_methods_are_listed_in_one_order_whatever_was_imported_first():
    """The registry lists the methods module by module as ``BUILTIN_MODULES`` orders them (the paper's
    comparison first), every built-in module registering at least one, whatever was imported first."""
    ranks = builtin_ranks()
    assert ranks == sorted(ranks) and set(range(len(BUILTIN_MODULES))) <= set(ranks)
    assert list(INIT_METHODS)[:4] == ["kaiming", "trunc-normal", "mimetic", "impulse"]  # the paper's four, its order
    assert fitting_methods().split(" / ") == [name for name, cls in INIT_METHODS.items() if cls.fits_data]
    assert "impulse" in fitting_methods().split(" / ")


# --------------------------------------------------------------------------- the source

#: The modules of the built-in methods: where a method's name, its spec class and its internals may appear.
OWN = {"init/baselines.py", "init/mimetic.py", "init/impulse.py", "init/impulse_checks.py", "init/impulse_solve.py",
       "init/impulse_write.py", "init/impulse_fit.py", "init/impulse_notices.py", "init/position_subspace.py",
       "init/content_qk.py", "init/authors.py", "init/registry.py", "init/mixed.py"}
METHOD_CLASSES = {cls.__name__ for cls in INIT_METHODS.values()}


def _about_a_method(node) -> bool:
    """Whether ``node`` reads an init method's name: ``.method``, ``method``, ``init``, ``["method"]``."""
    words = {"method", "init"}
    return any((isinstance(n, ast.Attribute) and n.attr in words) or (isinstance(n, ast.Name) and n.id in words)
               or (isinstance(n, ast.Constant) and n.value in words) for n in ast.walk(node))


def asks_which_method(tree):
    """``(line, what)`` of each place in ``tree`` that tells methods apart: a comparison of a method's
    name with one (``spec.method == "impulse"``, ``report["method"] in ("impulse", ...)``), an
    ``isinstance`` with a spec class, an import of a spec class or of a method's internals."""
    names = set(INIT_METHODS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            if consts and any(_about_a_method(side) for side in [node.left, *node.comparators]):
                found.append((node.lineno, f"compares with {consts[0].value!r}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & METHOD_CLASSES
            if classes:
                found.append((node.lineno, f"isinstance with {sorted(classes)}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            inner = node.module.rsplit(".", 1)[-1]
            if inner.startswith("impulse_") or any(a.name in METHOD_CLASSES for a in node.names):
                found.append((node.lineno, f"imports {node.module}: {', '.join(a.name for a in node.names)}"))
    return found


def test_no_code_outside_a_methods_modules_asks_which_method_it_runs():
    """Code that runs an init calls the spec's hooks; only a method's own modules (and the registry,
    which imports them) name it or reach into it."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OWN:
            continue
        wrong += [f"{rel}:{line} {what}" for line, what in asks_which_method(ast.parse(path.read_text()))]
    assert wrong == []


def test_the_source_check_finds_each_way_of_asking():
    code = ('if spec.method == "impulse": pass\nif r["method"] in ("mimetic", "x"): pass\nisinstance(s, ImpulseInit)\n'
            "from structinit.init.impulse_write import noise_notice\nfrom structinit.init.mimetic import MimeticInit\n"
            'init_spec("impulse")\nif filters == "impulse": pass\n')
    assert sorted(line for line, _ in asks_which_method(ast.parse(code))) == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- a method added in a module of its own

@pytest.fixture
def example_method():
    """``tests/example_init.py`` imported (which registers ``example-pca``), and taken out of the
    registry afterwards, so no other test sees it."""
    import example_init

    saved = dict(REGISTERED)
    REGISTERED.pop("example-pca", None)
    module = importlib.reload(example_init)
    try:
        yield module.ExamplePcaInit
    finally:
        REGISTERED.clear()
        REGISTERED.update((k, v) for k, v in saved.items() if k != "example-pca")


def first_layer_directions(model, x):
    """The principal directions (columns, by falling variance) of what the first block's qkv reads on
    ``x``, computed here with NumPy from timm's own modules."""
    with torch.no_grad():
        tokens = model.blocks[0].norm1(model.norm_pre(model._pos_embed(model.patch_embed(x))))
    flat = tokens.reshape(-1, tokens.shape[-1]).double().numpy()
    _, _, vt = np.linalg.svd(flat - flat.mean(axis=0), full_matrices=False)
    return vt.T


def test_a_method_added_in_its_own_module_passes_every_check(example_method, tmp_path):
    check_method(example_method, tmp_path)
    ranks = builtin_ranks()  # after every built-in method, which keep their order
    assert list(INIT_METHODS)[-1] == "example-pca" and ranks == sorted(ranks) and ranks[-1] == len(BUILTIN_MODULES)
    assert fitting_methods().split(" / ")[-1] == "example-pca"


def test_it_is_fitted_to_the_data_given_and_to_noise_without(example_method):
    from structinit.init.inject import read_qk

    model, x = tiny_vit(), images(16)
    report = initialize_model(model, "example-pca", data=x, scale=2.0)
    assert report["data_fit"] == {"inputs": "data", "samples": 16}
    t = AttentionTarget(model)
    q, k = read_qk(t.sd, t.slots[0], t.heads)
    want = first_layer_directions(tiny_vit(), x)  # the model before its init: what the fit read
    for h in range(2):
        got = (q[h] / 2.0).double().numpy()
        block = want[:, 16 * h:16 * (h + 1)]
        assert np.allclose(got @ got.T, block @ block.T, atol=1e-4)  # the same directions (signs aside)
    assert torch.equal(q, k)
    with pytest.warns(StructinitWarning, match="example-pca: no data given, so the directions are those of noise"):
        noisy = initialize_model(tiny_vit(), "example-pca")
    assert noisy["data_fit"] == {"inputs": "noise", "samples": 32}


def test_train_fits_it_to_the_runs_training_inputs(example_method, cli, tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "example-pca", "-p", "samples=24",
            "--epochs", "1", "--train-size", "64", "--patch", "2", "--depth", "1", "--dim", "32", "--heads", "2",
            "--batch-size", "32", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "config.json").read_text())
    assert doc["config"]["init"] == "example-pca" and doc["config"]["init_params"] == {"samples": 24}
    assert doc["init_report"]["data_fit"] == {"inputs": "data", "samples": 24}  # the run's training inputs


def test_apply_fits_it_through_the_model_the_checkpoint_describes(example_method, cli, tmp_path):
    from structinit.init.checkpoints import load_checkpoint

    torch.save(tiny_vit().state_dict(), tmp_path / "vit.pth")
    x = images(12)
    torch.save(x, tmp_path / "inputs.pt")
    r = cli("apply", tmp_path / "vit.pth", "--heads", "2", "--method", "example-pca", "--data", tmp_path / "inputs.pt",
            "--out", tmp_path / "out.pth", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["method"] == "example-pca" and report["data_fit"] == {"inputs": "data", "samples": 12}
    model = tiny_vit()
    own = initialize_model(model, "example-pca", data=x)
    assert report["self_mass"] == pytest.approx(own.extra["self_mass"], abs=1e-6)  # the method's own value, kept
    written = load_checkpoint(tmp_path / "out.pth").state_dicts[0][1]
    for key in ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"):
        assert torch.allclose(torch.as_tensor(written[key]), model.state_dict()[key], atol=1e-6)
    refused = cli("apply", tmp_path / "vit.pth", "--heads", "2", "--method", "mimetic", "--data",
                  tmp_path / "inputs.pt", "--out", tmp_path / "m.pth")
    assert refused.returncode == 2
    assert says(error_line(refused.stderr), "--data", fitting_methods(), "example-pca", "mimetic", "does not use it")


def test_a_second_method_under_a_registered_name_is_refused_and_the_first_kept():
    """Issue 54, case 20: a plugin registering ``impulse`` again is refused, naming both classes; the
    built-in stays registered (runs keep impulse's keys, the registry its spec)."""
    import dataclasses

    from structinit.init.base import InitSpec, register
    from structinit.init.impulse import ImpulseInit

    @dataclasses.dataclass(frozen=True)
    class ImpulseImpostor(InitSpec):
        method = "impulse"
        writes = "nothing"

    saved = dict(REGISTERED)
    try:
        with pytest.raises(ValueError, match=r"'impulse' is registered twice \(ImpulseInit, .*ImpulseImpostor\)"):
            register(ImpulseImpostor)
        assert REGISTERED["impulse"] is ImpulseInit and type(init_spec("impulse")) is ImpulseInit
        assert register(ImpulseInit) is ImpulseInit  # the same class again (a module reloaded) is not a second
    finally:  # a broken check must not leave the impostor registered for the tests after this one
        REGISTERED.clear()
        REGISTERED.update(saved)


def test_a_fitting_method_keeps_a_learned_position_embedding_it_does_not_replace(example_method, cli, tmp_path):
    """Issue 54, case 21: ``replaces_pos_embed`` defaults to no replacement, so ``apply --data`` with a
    data-fitting method that does not override it keeps a trained, learned (not sin-cos) pos_embed
    bit for bit, while its Q/K are written."""
    from structinit.init.checkpoints import load_checkpoint
    from structinit.init.pos_embed import pe_kind

    model = tiny_vit()
    with torch.no_grad():
        model.pos_embed.copy_(torch.randn(model.pos_embed.shape, generator=torch.Generator().manual_seed(3)))
    sd = state(model)
    assert pe_kind(sd["pos_embed"], (4, 4)) == "other"
    torch.save(sd, tmp_path / "learned.pth")
    torch.save(images(12), tmp_path / "inputs.pt")
    r = cli("apply", tmp_path / "learned.pth", "--heads", "2", "--method", "example-pca", "--data",
            tmp_path / "inputs.pt", "--out", tmp_path / "out.pth", "--json")
    assert r.returncode == 0, r.stderr
    written = load_checkpoint(tmp_path / "out.pth").state_dicts[0][1]
    assert torch.equal(torch.as_tensor(written["pos_embed"]), sd["pos_embed"])
    assert not torch.equal(torch.as_tensor(written["blocks.0.attn.qkv.weight"]), sd["blocks.0.attn.qkv.weight"])


def test_apply_prints_what_the_method_says_of_its_fit(example_method, tmp_path, cli):
    """``apply`` prints the init's own summary: a data-fitting method that is not impulse is not said
    to have written "the plain solve (--data-fit 0)"; it says what it was fitted on."""
    torch.save(tiny_vit().state_dict(), tmp_path / "vit.pth")
    torch.save(images(12), tmp_path / "inputs.pt")
    r = cli("apply", tmp_path / "vit.pth", "--heads", "2", "--method", "example-pca", "--data", tmp_path / "inputs.pt",
            "--out", tmp_path / "out.pth")
    assert r.returncode == 0, r.stderr
    assert "plain solve" not in r.stdout and "--data-fit" not in r.stdout
    said = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("example-pca: fitted")]
    assert len(said) == 1 and said[0].startswith("example-pca: fitted through timm VisionTransformer")
    assert said[0].endswith("on 12 real inputs")
