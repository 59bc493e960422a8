"""TrainConfig without training: the hyperparameters it resolves (defaults, per dataset, per model
family, then what is set), every setting it refuses and how it names it, and a run key that moves
with what is computed and with nothing else."""

import dataclasses

import pytest

from structinit.errors import UsageError
from structinit.training.config import DATASET_HPARAMS, EXECUTION_FIELDS, HPARAMS, TrainConfig, causal_refused


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
    (dict(augment="mixup"), "unknown augment 'mixup'; choose one of randaugment, crop-flip, flip, none"),
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
    (dict(init="xavier"), "unknown init method init 'xavier'"),
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
                     pos_embed="learned", drop_path=0.1).model_config()
    assert (mc.name, mc.dim, mc.heads, mc.depth, mc.patch, mc.mlp_ratio, mc.pool, mc.pos_embed, mc.drop_path) == \
        ("vit-t", 48, 3, 2, 4, 3.0, "token", "learned", 0.1)
    cm = TrainConfig(model="convmixer-256", kernel=5, filters="box").model_config()
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
    assert d["init"] == BASE.init_spec().to_dict() and d["init"]["params"]["filter"] == BASE.init_spec().filter
    assert d["epochs"] == 40 and d["augment"] == "none" and d["data_seed"] == 0 and d["eval_every"] == 1
    assert TrainConfig().computed_settings()["init"] is None and TrainConfig().init_spec() is None


def test_dict_round_trip_and_unknown_settings():
    assert TrainConfig.from_dict(BASE.to_dict()) == BASE
    with pytest.raises(UsageError, match="unknown training setting"):
        TrainConfig.from_dict(dict(BASE.to_dict(), colour="red", size=1))
    with pytest.raises(UsageError) as exc:
        TrainConfig.from_dict({"colour": 1, "bogus": 2})
    assert str(exc.value) == "unknown training setting(s) bogus, colour"


def test_causal_refusals_name_the_flag_or_the_artifact():
    """Causal offsets on a model that attends both ways: the user's own flag is named, and an
    artifact solved causal is named by its key (the user did not give the flag)."""
    flag = causal_refused("vit-digits")
    assert isinstance(flag, UsageError)
    assert flag.render(lambda n: f"--{n}") == ("--causal solves for a decoder's causal mask, but vit-digits attends "
                                               "both ways: leave it out")
    art = causal_refused("transformer-1d", artifact="0123abcd4567")
    assert art.render(lambda n: f"<{n}>") == ("the artifact 0123abcd4567 was solved for a decoder's causal mask "
                                              "(<causal>), but transformer-1d attends both ways: give one solved "
                                              "without it")
