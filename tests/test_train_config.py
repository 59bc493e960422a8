"""TrainConfig without training: the hyperparameters it resolves (defaults, per dataset, per model
family, then what is set), every setting it refuses and how it names it, and a run key that moves
with what is computed and with nothing else."""

import dataclasses

import pytest
from conftest import says

from structinit.errors import UsageError
from structinit.init.registry import init_spec
from structinit.training.config import (
    DATASET_HPARAMS,
    EXECUTION_FIELDS,
    HPARAMS,
    MODEL_SETTINGS,
    TrainConfig,
    causal_refused,
    flat_settings,
)
from structinit.training.models import ModelConfig


def test_hparams_take_defaults_then_dataset_then_model_family_then_fields():
    cifar = TrainConfig(model="vit-t", dataset="cifar10").hparams()
    assert {k: cifar[k] for k in HPARAMS} == HPARAMS
    assert cifar["augment"] == "randaugment" and cifar["eval_every"] == 4  # 200 epochs // 50
    digits = TrainConfig().hparams()
    assert {k: digits[k] for k in DATASET_HPARAMS["digits"]} == DATASET_HPARAMS["digits"]
    assert digits["lr"] == HPARAMS["lr"] and digits["augment"] == "none" and digits["eval_every"] == 1
    folder = TrainConfig(model="vit-t", dataset="imagefolder").hparams()
    assert (folder["epochs"], folder["weight_decay"], folder["warmup_epochs"]) == (300, 0.05, 20)
    mixer = TrainConfig(model="convmixer-256", dataset="digits").hparams()
    assert mixer["lr"] == 0.01 and mixer["epochs"] == 100 and mixer["batch_size"] == 64  # family over dataset
    mine = TrainConfig(model="convmixer-256", dataset="digits", epochs=7, lr=0.5, augment="flip", eval_every=3,
                       label_smoothing=0.1).hparams()
    assert (mine["epochs"], mine["lr"], mine["augment"], mine["eval_every"], mine["label_smoothing"]) == \
        (7, 0.5, "flip", 3, 0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(epochs=0), "epochs must be a positive integer, got 0"),
    (dict(epochs=True), "epochs must be a positive integer, got True"),
    (dict(epochs=2.5), "epochs must be a positive integer, got 2.5"),
    (dict(batch_size=-1), "batch_size must be a positive integer, got -1"),
    (dict(eval_every=0), "eval_every must be a positive integer, got 0"),
    (dict(eval_every=-2), "eval_every must be a positive integer, got -2"),
    (dict(lr=float("nan")), "lr must be a finite number, got nan"),
    (dict(lr="0.1"), "lr must be a finite number, got '0.1'"),
    (dict(min_lr=True), "min_lr must be a finite number, got True"),
    (dict(lr=0.0), "lr must be positive, got 0.0"),
    (dict(opt_eps=-1e-8), "opt_eps must be positive, got -1e-08"),
    (dict(weight_decay=-0.1), "weight_decay must not be negative, got -0.1"),
    (dict(warmup_epochs=-1), "warmup_epochs must not be negative, got -1"),
    (dict(grad_clip=-1.0), "grad_clip must not be negative, got -1.0"),
    (dict(randaug_n=-1), "randaug_n must not be negative, got -1"),
    (dict(randaug_m=-1), "randaug_m must not be negative, got -1"),
    (dict(min_lr=0.1, lr=0.01), "min_lr 0.1 is above lr 0.01"),
    (dict(label_smoothing=1.0), r"label_smoothing must be in \[0, 1\), got 1.0"),
    (dict(label_smoothing=-0.1), r"label_smoothing must be in \[0, 1\), got -0.1"),
    (dict(augment="mixup"), "unknown augment 'mixup'; choose one of randaugment, crop-flip, flip, shift, none"),
])
def test_hyperparameters_that_cannot_train_are_refused_by_name(kwargs, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**kwargs).validate()


def test_boundary_values_that_are_allowed():
    TrainConfig(min_lr=1e-3, lr=1e-3, weight_decay=0, warmup_epochs=0, grad_clip=0, label_smoothing=0,
                randaug_n=0, randaug_m=0, epochs=1, batch_size=1, eval_every=1).validate()


@pytest.mark.parametrize("kwargs, message", [
    (dict(init_params={"filter": 3}), "init_params needs init"),
    (dict(model="convmixer-256", init="impulse"), "the ViT presets and transformer-1d; convmixer-256 keeps"),
    (dict(init="impulse", init_params={"nope": 1}), "has no parameter nope"),
    (dict(init="xavier"), "unknown init method 'xavier'; init takes one of"),
    (dict(device="tpu"), "unknown device 'tpu'"),
    (dict(threads=0), "threads must be at least 1, got 0"),
    (dict(amp="fp8"), "unknown amp 'fp8'; choose one of auto, bf16, fp16, off"),
    (dict(workers=-1), "workers must not be negative, got -1"),
    (dict(resume=True), "resume needs out DIR"),
    (dict(train_size=0), "train_size must be an integer of at least 1, got 0"),
    (dict(train_size=True), "train_size must be an integer of at least 1, got True"),
    (dict(train_size=10.0), "train_size must be an integer of at least 1, got 10.0"),
    (dict(data_seed=-1), "data_seed must be an integer of at least 0, got -1"),
    (dict(val_size=-1), "val_size must be a non-negative integer, got -1"),
    (dict(val_size=True), "val_size must be a non-negative integer, got True"),
    (dict(dataset="mnist"), "unknown dataset 'mnist'"),
])
def test_settings_that_cannot_run_are_refused_by_name(kwargs, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**kwargs).validate()


def test_allowed_edges_of_the_settings():
    hp = TrainConfig(train_size=1, data_seed=0, val_size=0, workers=0, threads=1, device="cuda:1", amp="off",
                     resume=True, out="somewhere").validate()
    assert hp["epochs"] == 40
    assert TrainConfig(init="kaiming").validate()["epochs"] == 40


BASE = TrainConfig(dataset="digits", init="impulse", init_params={"filter": 3})

#: Every setting that changes what is computed, with another value.
COMPUTED = dict(model="vit-t", dataset="synthetic", dim=48, heads=3, depth=2, patch=2, mlp_ratio=3.0, pool="token",
                pos_embed="learned", drop_path=0.1, init="mimetic", image_size=16, augment="flip", train_size=100,
                val_size=10, data_seed=5, epochs=3, batch_size=16, lr=0.5, min_lr=1e-7, weight_decay=0.2,
                warmup_epochs=1.5, opt_eps=1e-6, grad_clip=1.0, label_smoothing=0.1, randaug_n=1, randaug_m=5,
                eval_every=2, seed=9)


@pytest.mark.parametrize("name", sorted(COMPUTED))
def test_every_computed_setting_moves_the_key(name):
    base = dataclasses.replace(BASE, init_params={}) if name == "init" else BASE
    assert dataclasses.replace(base, **{name: COMPUTED[name]}).key != base.key, name


def test_model_settings_reach_the_model_config():
    mc = TrainConfig(model="vit-t", dim=48, heads=3, depth=2, patch=4, mlp_ratio=3.0, pool="token",
                     pos_embed="learned", drop_path=0.1).model
    assert (mc.name, mc.dim, mc.heads, mc.depth, mc.patch, mc.mlp_ratio, mc.pool, mc.pos_embed, mc.drop_path) == \
        ("vit-t", 48, 3, 2, 4, 3.0, "token", "learned", 0.1)
    cm = TrainConfig(model="convmixer-256", kernel=5, filters="box").model
    assert (cm.kernel, cm.filters, cm.family) == (5, "box", "convmixer")
    with pytest.raises(UsageError, match="ConvMixer presets only"):
        TrainConfig(kernel=3).validate()


@pytest.mark.parametrize("name", EXECUTION_FIELDS)
def test_execution_settings_leave_the_key(name):
    other = {"out": "x", "resume": True, "device": "cpu", "workers": 0, "threads": 2, "compile": True,
             "data_dir": "/d", "download": True, "amp": "off", "eval_batch_size": 64}
    assert dataclasses.replace(BASE, **{name: other[name]}).key == BASE.key


def test_defaults_spelled_out_are_the_same_run():
    assert TrainConfig(epochs=40, batch_size=64, augment="none").key == TrainConfig().key
    assert TrainConfig(data_seed=0).key == TrainConfig().key  # data_seed defaults to seed
    assert TrainConfig(data_seed=1).key != TrainConfig().key
    assert TrainConfig(init="impulse").key == TrainConfig(init="impulse", init_params={"filter": 3,
                                                                                       "recipe": "fast"}).key
    assert TrainConfig(init="impulse", init_params={"filter": 5}).key != TrainConfig(init="impulse").key
    assert len(BASE.key) == 12 and all(c in "0123456789abcdef" for c in BASE.key)


def test_computed_settings_hold_the_resolved_run():
    d = BASE.computed_settings()
    assert not set(EXECUTION_FIELDS) & set(d) and "init_params" not in d
    assert d["init"] == BASE.init.to_dict() and d["init"]["params"]["filter"] == BASE.init.filter
    assert d["epochs"] == 40 and d["augment"] == "none" and d["data_seed"] == 0 and d["eval_every"] == 1
    assert TrainConfig().computed_settings()["init"] is None and TrainConfig().init is None


def test_dict_round_trip_and_unknown_settings():
    assert TrainConfig.from_dict(BASE.to_dict()) == BASE
    with pytest.raises(UsageError, match="unknown training setting"):
        TrainConfig.from_dict(dict(BASE.to_dict(), colour="red", size=1))
    with pytest.raises(UsageError) as exc:
        TrainConfig.from_dict({"colour": 1, "bogus": 2})
    assert says(str(exc.value), "unknown training setting", "bogus, colour")


def test_causal_refusals_name_the_flag_or_the_artifact():
    """Causal offsets on a model that attends both ways: the user's own flag is named, and an
    artifact solved causal is named by its key (the user did not give the flag)."""
    flag = causal_refused("vit-digits")
    assert isinstance(flag, UsageError)
    assert says(flag.render(lambda n: f"--{n}"), "--causal", "causal mask", "vit-digits", "both ways", "leave it out")
    art = causal_refused("transformer-1d", artifact="0123abcd4567")
    assert says(art.render(lambda n: f"<{n}>"), "artifact 0123abcd4567", "<causal>", "transformer-1d", "both ways",
                "solved without it")
    assert "leave it out" not in art.render()  # the user did not give the flag


# --------------------------------------------------------------------------- the flat form and run keys

#: Run keys computed before TrainConfig held a ModelConfig and an InitSpec (commit 55f3fe8, when its
#: fields were flat): the derivation of every committed key (docs/results/**/runs.csv), so these
#: literals must never move for the flat settings as a config.json of then holds them
#: (:meth:`TrainConfig.from_dict`, which reads a missing base as the model's own, as it was).
#: Each entry: the flat settings, the key.
KEYS_BEFORE_NESTING = [
    (dict(), "9d238275eca8"),
    (dict(init="impulse", init_params={"filter": 5, "target_mass": 0.4, "data_fit": 20}, train_size=100),
     "5f1906dc3774"),
    (dict(init="impulse", init_params={"filter": 3}), "56b272575a62"),  # a default spelt out: the plain impulse run
    (dict(init="mimetic", init_params={"alpha1": 1, "beta1": "0"}), "93d475d827aa"),  # values as text or int
    (dict(init="mimetic", seed=3, val_size=300, data_seed=2), "18d058902017"),
    (dict(model="vit-t", dataset="cifar10", init="impulse",
          init_params={"recipe": "paper", "recipe_params": {"iters": 20}, "data-fit": 0}), "6f752c51f94f"),
    (dict(model="vit-t", dim=48, heads=3, depth=2, patch=4, mlp_ratio=3.0, pool="token", pos_embed="learned",
          drop_path=0.1, dataset="cifar10", epochs=3, lr=0.002), "4d44c991845c"),
    (dict(model="convmixer-256", dataset="synthetic", dim=16, depth=2, kernel=3, filters="box", epochs=1),
     "134feeb18b24"),
    (dict(model="transformer-1d", dataset="mnist1d", window=3, init="impulse", init_params={"filter": 5}),
     "30f7dff626d1"),
    (dict(model="cnn-1d", dataset="mnist1d", shuffle_seq=True, kernel=3), "974d94e5189f"),
    (dict(model="vit-t", dataset="imagefolder", image_size=48, data_dir="/data", augment="flip"), "e0223af6563d"),
    (dict(model="vit-t", dataset="cifar10", out="runs/x", resume=True, device="cpu", workers=0, threads=1,
          amp="off", eval_batch_size=99, compile=True, data_dir="/d", download=True), "6eaf490df04d"),
    *[(dict(model=name, dataset="cifar10"), key) for name, key in [
        ("vit-t", "6eaf490df04d"), ("vit-t-h8", "adab6777eb4a"), ("vit-s", "8e74a4dd68e7"),
        ("vit-s-h16", "5a660aa71e63"), ("vit-d8", "0f33a7dacb78"), ("vit-digits", "63104f96942d"),
        ("vit-fashion", "865157380712"), ("vit-fashion-196", "8105f25dbf7e"), ("vit-t-cls", "6c354c8e459f"),
        ("vit-t-learned-pe", "610d94975e68"), ("vit-t-cls-learned-pe", "c525c995d27f"), ("convit", "11a6c5b4a5d5"),
        ("convmixer-256", "ebf4c0ac872a"), ("convmixer-512", "4891d95ed779")]],
    (dict(model="transformer-1d", dataset="mnist1d"), "1307262d8f64"),
    (dict(model="cnn-1d", dataset="mnist1d"), "a11b3a9bd766"),
]


def test_every_model_preset_has_a_literal_key():
    from structinit.training.models import PRESETS

    assert {settings.get("model", "vit-digits") for settings, _ in KEYS_BEFORE_NESTING} >= set(PRESETS)


@pytest.mark.parametrize("settings, key", KEYS_BEFORE_NESTING, ids=lambda v: v if isinstance(v, str) else None)
def test_run_keys_are_the_literal_keys_of_before(settings, key):
    config = TrainConfig.from_dict(settings)
    assert config.key == key
    assert TrainConfig.from_dict(config.to_dict()).key == key
    rest = {k: v for k, v in settings.items() if k not in MODEL_SETTINGS + ("model", "init", "init_params")}
    nested = TrainConfig(model=config.model, init=config.init, **rest)
    assert nested == config and nested.key == key


def test_a_grid_with_overrides_expands_to_the_literal_keys_of_before():
    from structinit.experiments.expand import expand
    from structinit.experiments.gridspec import load_grid

    ex = expand(load_grid("digits"), overrides=["epochs=2", "init_params.target_mass=0.5", "val_size=200", "lr=0.002"],
                seeds=[0, 4], only=["train_size=100"])
    assert {(c.row, c.seed): c.key for c in ex.cells} == {
        ("trunc-normal", 0): "3aaaf141e1d6", ("trunc-normal", 4): "8f5f25bcec3e",
        ("kaiming", 0): "2d418ad91296", ("kaiming", 4): "db3b60a76b0a",
        ("mimetic", 0): "5964e6959d62", ("mimetic", 4): "b3ffa49497cd",
        ("conditioned", 0): "8871463add6d", ("conditioned", 4): "c31e9cede601",
        ("impulse", 0): "d3aa89f83fb1", ("impulse", 4): "4717ee2d3e46",
        ("impulse-plain", 0): "a89b5537eedc", ("impulse-plain", 4): "d5a20c09444d",
        ("impulse-2024", 0): "9c6c99e0e0a8", ("impulse-2024", 4): "285fdd3e0eb7",
        ("impulse-2025", 0): "e6454845e6a2", ("impulse-2025", 4): "86e098faf02d",
        ("convmixer", 0): "3b02e0c21530", ("convmixer", 4): "359637e66693"}


#: A config.json's "config" as TrainConfig wrote it before the nesting (key order included).
FLAT_BEFORE = ('{"model": "transformer-1d", "dataset": "mnist1d", "out": null, "resume": false, "dim": null, '
               '"heads": null, "depth": null, "patch": null, "mlp_ratio": null, "pool": null, "pos_embed": null, '
               '"kernel": null, "filters": "trained", "drop_path": 0.0, "window": 3, "init": "impulse", '
               '"init_params": {"filter": 5}, "data_dir": null, "download": false, "image_size": null, '
               '"augment": null, "train_size": null, "val_size": 0, "data_seed": null, "shuffle_seq": false, '
               '"epochs": null, "batch_size": null, "lr": null, "min_lr": null, "weight_decay": null, '
               '"warmup_epochs": null, "opt_eps": null, "grad_clip": null, "label_smoothing": null, '
               '"randaug_n": null, "randaug_m": null, "eval_every": null, "seed": 0, "device": "auto", '
               '"amp": "auto", "compile": false, "workers": 4, "threads": null, "eval_batch_size": null}')


def test_the_flat_form_is_written_back_byte_for_byte_with_its_base_spelt_out():
    """A config.json of before names no base: it is the model's own, which the form written back
    spells out (a command made from it must not take train's default base), key unchanged."""
    import json

    config = TrainConfig.from_dict(json.loads(FLAT_BEFORE))
    want = FLAT_BEFORE.replace('"init_params": {"filter": 5}', '"init_params": {"filter": 5, "base": "model"}')
    assert json.dumps(config.to_dict()) == want and config.key == "30f7dff626d1"
    assert TrainConfig.from_dict(json.loads(want)).key == "30f7dff626d1"
    assert (config.model.name, config.model.window, config.init.method, config.init.filter) == \
        ("transformer-1d", 3, "impulse", 5)
    assert list(config.to_dict()) == list(flat_settings())
    # a run folder from before window and shuffle_seq: the plain transformer-1d run
    older = {k: v for k, v in json.loads(FLAT_BEFORE).items() if k not in ("window", "shuffle_seq")}
    assert TrainConfig.from_dict(dict(older, init=None, init_params={})).key == "1307262d8f64"


def test_an_init_named_for_train_starts_the_other_weights_from_the_mlp_base():
    """On a model train builds, impulse and mimetic named without a base get TRAIN_BASE (new run
    keys); base=model spelt out is the run of before; a spec given as an object is taken as it is;
    an init without a base parameter is left alone."""
    from structinit.init.impulse import ImpulseInit
    from structinit.training.config import TRAIN_BASE

    assert TRAIN_BASE == "pytorch-mlp"
    for method, before in (("impulse", "56b272575a62"), ("mimetic", None)):
        named = TrainConfig(init=method)
        assert named.init.base == "pytorch-mlp" and named.init_params == {"base": "pytorch-mlp"}
        model = TrainConfig(init=method, init_params={"base": "model"})
        assert model.init.base == "model" and model.key != named.key
        if before:
            assert model.key == TrainConfig.from_dict({"init": method, "init_params": {"filter": 3}}).key == before
        assert TrainConfig.from_dict(named.to_dict()).key == named.key  # the base is written with the run
    assert TrainConfig(init=ImpulseInit()).init.base == "model"
    assert TrainConfig(init="trunc-normal").init_params == {} and TrainConfig(init="kaiming").init_params == {}


def test_init_params_are_written_as_given_while_they_spell_the_init():
    given = TrainConfig(init="mimetic", init_params={"alpha1": 1, "beta1": "0"}, epochs=2)
    assert given.init.alpha1 == 1.0 and given.init.beta1 == 0.0  # typed in the spec
    spelt = {"alpha1": 1, "beta1": "0", "base": "pytorch-mlp"}  # as given, and train's base for what was not
    assert given.to_dict()["init_params"] == spelt
    assert dataclasses.replace(given, out="x").init_params == spelt
    other = dataclasses.replace(given, init=init_spec("mimetic", alpha1=0.5))
    assert other.init_params == {"alpha1": 0.5} and other.key != given.key
    assert TrainConfig(init=init_spec("impulse", filter=5)).init_params == {"filter": 5}
    assert TrainConfig(init=init_spec("impulse", filter=5), init_params={"share": True}).init == \
        init_spec("impulse", filter=5, share=True)  # init_params replace a spec's parameters
    assert TrainConfig().init_params == {} and TrainConfig().to_dict()["init"] is None


def test_model_settings_beside_a_model_config_replace_its_own():
    config = TrainConfig(model=ModelConfig("vit-t", dim=48, heads=3), heads=6, epochs=2)
    assert config.model == ModelConfig("vit-t", dim=48, heads=6)
    assert dataclasses.replace(config, depth=2).model == ModelConfig("vit-t", dim=48, heads=6, depth=2)
    assert dataclasses.replace(config, model="vit-s").model == ModelConfig("vit-s")  # a preset by name: no overrides
    assert set(MODEL_SETTINGS) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    assert set(MODEL_SETTINGS) < set(flat_settings())  # a new ModelConfig field is a setting at once


def test_building_a_config_checks_its_parts_by_name():
    with pytest.raises(UsageError, match="unknown model 'vit-q'"):
        TrainConfig(model="vit-q")
    with pytest.raises(UsageError, match="dim must be positive, got 0"):
        TrainConfig(dim=0)
    with pytest.raises(UsageError, match="init_params needs init"):
        TrainConfig(init_params={"filter": 3})
    with pytest.raises(UsageError) as exc:
        TrainConfig(colour="red", model_name="vit-t")
    assert says(str(exc.value), "unknown training setting", "colour, model_name")
