"""``TrainConfig``: every setting of a training run, its resolved hyperparameters and its run key.

Hyperparameters default to the structured-initialization paper's recipe for CIFAR-sized data
(:data:`HPARAMS`: AdamW lr 1e-3, weight decay 0.01, batch 512, 200 epochs, cosine to 1e-6 after 10
warm-up epochs, eps 1e-3, grad clip 3.0, RandAugment), changed per dataset and model family
(:data:`DATASET_HPARAMS`, :data:`MODEL_HPARAMS`); every field left ``None`` takes that default and
every one can be set.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec
from structinit.init.baselines import SCRATCH_BASE
from structinit.keys import json_key
from structinit.training.models import ModelConfig

#: The paper's recipe (and its released README) for 32x32 images.
HPARAMS: Dict[str, Any] = dict(epochs=200, batch_size=512, lr=1e-3, min_lr=1e-6, weight_decay=0.01, warmup_epochs=10,
                               opt_eps=1e-3, grad_clip=3.0, label_smoothing=0.0, randaug_n=2, randaug_m=9)
#: Per-dataset changes to :data:`HPARAMS`. digits: 1437 images want small batches, and with only
#: ~900 steps Adam's eps 1e-3 damps the small early gradients so much that the loss sits at ln(10)
#: for epochs; eps 1e-8 trains.
DATASET_HPARAMS: Dict[str, Dict[str, Any]] = {
    "digits": dict(epochs=40, batch_size=64, warmup_epochs=2, opt_eps=1e-8),
    "synthetic": dict(epochs=10, batch_size=64, warmup_epochs=1, opt_eps=1e-8),
    "imagefolder": dict(epochs=300, batch_size=256, weight_decay=0.05, warmup_epochs=20),
    # MNIST-1D: 4000 sequences of 40 values; chosen on a 500-sequence validation split (docs/results/mnist1d).
    "mnist1d": dict(epochs=20, batch_size=64, warmup_epochs=2, opt_eps=1e-8),
}
#: The first training inputs a run's init is fitted to (``data_fit``) and its attention at init is
#: measured on (``train``, ``inspect --data``).
FIDELITY_SAMPLES = 256
#: The base of the weights an init does not write on a model ``train`` builds, for an init named
#: without one (``init_params`` without ``base``): the MLPs at PyTorch's default init, chosen on the
#: validation splits of the Fashion-MNIST and digits learning curves (docs/results/structure-gain).
#: ``initialize_model`` and ``apply``, which write into a model or checkpoint of the user's, keep its
#: weights (``base="model"``); a run whose ``config.json`` names no base was made before this default
#: and keeps ``model`` (:meth:`TrainConfig.from_dict`).
TRAIN_BASE = SCRATCH_BASE
#: Per-model-family changes (the paper's Table 4: ConvMixer at lr 0.01 for 100 epochs).
MODEL_HPARAMS: Dict[str, Dict[str, Any]] = {"convmixer": dict(lr=0.01, epochs=100)}

AMP_MODES = ("auto", "bf16", "fp16", "off")
#: Settings that do not change what is computed: they may differ when a run is resumed, and they
#: are not part of the run key.
EXECUTION_FIELDS = ("out", "resume", "device", "workers", "threads", "compile", "data_dir", "download", "amp",
                    "eval_batch_size")
#: Settings added after run keys were first written: part of the key only when not at these
#: defaults, so every earlier run keeps its key.
OPTIONAL_DEFAULTS: Dict[str, Any] = {"window": None, "shuffle_seq": False}


def causal_refused(model: str, artifact: Optional[str] = None) -> UsageError:
    """The error for causal impulse offsets on a model ``train`` builds: they are solved under a
    decoder's mask, and these models attend both ways. ``artifact``: the key of an artifact, given
    by path or key, that was solved with ``causal`` (the user did not ask for it here)."""
    if artifact is not None:
        return UsageError(f"the artifact {artifact} was solved for a decoder's causal mask ({param('causal')}), but "
                          f"{model} attends both ways: give one solved without it")
    return UsageError(f"{param('causal')} solves for a decoder's causal mask, but {model} attends both ways: "
                      "leave it out")


#: The settings of :class:`~structinit.training.models.ModelConfig` besides its preset ``name``:
#: in the flat form they stand beside ``model`` (the preset), as ``structinit train``'s options do.
MODEL_SETTINGS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "name")


@dataclass(init=False)
class TrainConfig:
    """Everything a training run depends on. ``None`` means the default (see the module docstring).

    ``model``: the :class:`~structinit.training.models.ModelConfig` (a preset and its overrides).
    ``init``: the :class:`~structinit.init.base.InitSpec` of the attention init (``None``: the
    model's own init, timm's trunc normal for ViTs). Data: ``dataset``, ``data_dir``, ``download``,
    ``image_size`` (imagefolder), ``augment`` (``randaugment``, ``crop-flip``, ``flip``, ``shift``, ``none``),
    ``train_size`` (a stratified subset of the training split, drawn with ``data_seed``, default
    ``seed``), ``val_size`` (training images held out for validation, stratified, the same for every
    seed), ``shuffle_seq`` (sequence datasets: one fixed permutation of the positions, MNIST-1D's
    sanity check for locality). ``batch_size`` is the global batch (split over processes);
    ``eval_every``: epochs between evaluations (``None``: about 50 per run; the last epoch is always
    evaluated). ``threads``: torch CPU threads of each process.

    The constructor takes keywords only, in the nested form, the flat form or a mix::

        TrainConfig(model=ModelConfig("vit-t", dim=48), init=init_spec("impulse", filter=5), epochs=3)
        TrainConfig(model="vit-t", dim=48, init="impulse", init_params={"filter": 5}, epochs=3)

    The flat form is :meth:`to_dict`'s (``config.json``, checkpoints, the run key, grid files and
    the options of ``structinit train``): ``model`` is the preset's name with the model's settings
    (:data:`MODEL_SETTINGS`: ``dim``, ``heads``, ...) beside it, ``init`` the init method's name with
    its ``init_params``. Model settings given beside a :class:`ModelConfig` replace its own, and
    ``init_params`` given with an :class:`InitSpec` replace its parameters. Building the config
    checks the model and the init (a :class:`~structinit.errors.UsageError` naming the parameter);
    :meth:`validate` checks how the settings go together.
    """

    model: ModelConfig = ModelConfig()
    dataset: str = "digits"
    out: Optional[str] = None
    resume: bool = False
    init: Optional[InitSpec] = None
    # data
    data_dir: Optional[str] = None
    download: bool = False
    image_size: Optional[int] = None
    augment: Optional[str] = None
    train_size: Optional[int] = None
    val_size: int = 0
    data_seed: Optional[int] = None
    shuffle_seq: bool = False
    # hyperparameters
    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup_epochs: Optional[float] = None
    opt_eps: Optional[float] = None
    grad_clip: Optional[float] = None
    label_smoothing: Optional[float] = None
    randaug_n: Optional[int] = None
    randaug_m: Optional[int] = None
    eval_every: Optional[int] = None
    # execution
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    compile: bool = False
    workers: int = 4
    threads: Optional[int] = None
    eval_batch_size: Optional[int] = None
    #: ``(spec, init_params)`` when ``init`` was given by name: the parameters as they were given, so
    #: that :meth:`to_dict` writes them back unchanged (a run's ``config.json`` keeps its bytes)
    #: while ``init`` is still that spec. Not a setting: equal configs may spell their init apart.
    init_spelling: Optional[Tuple[InitSpec, Dict[str, Any]]] = field(default=None, compare=False, repr=False)

    def __init__(self, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(_FIELD_NAMES) - set(MODEL_SETTINGS) - {"init_params"})
        if unknown:
            raise UsageError(f"unknown training setting(s) {', '.join(param(u) for u in unknown)}")
        for f in dataclasses.fields(self):
            if f.name in settings:
                value = settings[f.name]
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, f.name, value)
        self.model = _model_config(self.model, {k: settings[k] for k in MODEL_SETTINGS if k in settings})
        self.init, self.init_spelling = _init_spec(self.init, settings.get("init_params"), self.init_spelling)

    @property
    def init_params(self) -> Dict[str, Any]:
        """The init's parameters as the flat form writes them (a copy): as given with ``init`` by
        name, else those of ``init`` that differ from their defaults; ``{}`` without an init."""
        if self.init is None:
            return {}
        if self.init_spelling is not None and self.init_spelling[0] == self.init:
            return copy.deepcopy(self.init_spelling[1])
        return _changed_params(self.init)

    def hparams(self) -> Dict[str, Any]:
        """The resolved hyperparameters: :data:`HPARAMS` < dataset < model family < the fields set here."""
        from structinit.training.datasets import dataset_info

        info = dataset_info(self.dataset)
        out = dict(HPARAMS)
        out.update(DATASET_HPARAMS.get(self.dataset, {}))
        out.update(MODEL_HPARAMS.get(self.model.family, {}))
        for key in HPARAMS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["augment"] = self.augment or info.augment
        out["eval_every"] = self.eval_every if self.eval_every is not None else max(1, int(out["epochs"]) // 50)
        _check_hparams(out)
        return out

    def validate(self) -> Dict[str, Any]:
        """Check every setting that can be checked without torch or data; return :meth:`hparams`."""
        hp = self.hparams()
        self._check_model_fits_init_and_data(hp)
        self._check_execution()
        self._check_data()
        return hp

    def _check_model_fits_init_and_data(self, hp: Dict[str, Any]) -> None:
        from structinit.training.datasets import SHUFFLABLE, dataset_info
        from structinit.training.models import ATTENTION_FAMILIES

        name = self.model.name
        if self.init is not None and self.model.family not in ATTENTION_FAMILIES:
            raise UsageError(f"{param('init')} applies to the ViT presets and transformer-1d; {name} keeps its "
                             "own init")
        info = dataset_info(self.dataset)
        if info.is_sequence != self.model.is_sequence:
            want = "a sequence model (transformer-1d, cnn-1d)" if info.is_sequence else "an image model"
            raise UsageError(f"{param('dataset')} {self.dataset} holds {info.kind}s; {param('model')} {name} "
                             f"is not for them: choose {want}")
        if info.is_sequence and hp["augment"] != "none":
            raise UsageError(f"{param('augment')} {hp['augment']} is an image augmentation; {self.dataset} is a "
                             "sequence dataset (use none)")
        if self.shuffle_seq and self.dataset not in SHUFFLABLE:
            raise UsageError(f"{param('shuffle_seq')} applies to sequence datasets ({', '.join(SHUFFLABLE)}), not "
                             f"{self.dataset}")
        if self.init is not None and self.init.is_causal():
            raise causal_refused(name)  # an artifact's own flag is checked once train reads it

    def _check_execution(self) -> None:
        from structinit.runtime import check_device, check_threads

        check_device(self.device)
        check_threads(self.threads)
        if self.amp not in AMP_MODES:
            raise UsageError(f"unknown {param('amp')} {self.amp!r}; choose one of {', '.join(AMP_MODES)}")
        if self.workers < 0:
            raise UsageError(f"{param('workers')} must not be negative, got {self.workers}")
        if self.resume and not self.out:
            raise UsageError(f"{param('resume')} needs {param('out')} DIR")

    def _check_data(self) -> None:
        if self.image_size is not None and self.dataset != "imagefolder":
            raise UsageError(f"{param('image_size')} applies to the imagefolder dataset; {self.dataset} has a fixed "
                             "image size")
        if self.dataset in ("digits", "synthetic") and (self.data_dir is not None or self.download):
            raise UsageError(f"{param('data_dir')} and {param('download')} do not apply to the {self.dataset} dataset, "
                             "which needs no files")
        for name, lowest in (("train_size", 1), ("data_seed", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise UsageError(f"{param(name)} must be an integer of at least {lowest}, got {value!r}")
        if not isinstance(self.val_size, int) or isinstance(self.val_size, bool) or self.val_size < 0:
            raise UsageError(f"{param('val_size')} must be a non-negative integer, got {self.val_size!r}")

    def to_dict(self) -> Dict[str, Any]:
        """The flat form (see the class docstring), every setting in the order of
        :func:`flat_settings`: what ``config.json`` and checkpoints hold and the run key hashes."""
        own = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.compare}
        model = dataclasses.asdict(self.model)
        flat = {"model": model.pop("name")}
        flat.update({name: own[name] for name in ("dataset", "out", "resume")})
        flat.update(model)
        flat.update(init=self.init.method if self.init is not None else None, init_params=self.init_params)
        flat.update({name: value for name, value in own.items() if name not in flat})
        return flat

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        """The config of a flat form (:meth:`to_dict`; also a ``config.json`` of an earlier version,
        which may lack settings added since: they take their defaults)."""
        unknown = sorted(set(d) - set(flat_settings()))
        if unknown:
            raise UsageError(f"unknown training setting(s) {', '.join(param(u) for u in unknown)}")
        d = dict(d)
        if _takes_base(d.get("init")) and "base" not in (d.get("init_params") or {}):
            d["init_params"] = {**(d.get("init_params") or {}), "base": "model"}  # written before TRAIN_BASE
        return cls(**d)

    def computed_settings(self) -> Dict[str, Any]:
        """What determines the computation: every field but :data:`EXECUTION_FIELDS`, with the
        hyperparameters resolved and the init as its spec's canonical form (so ``epochs=None`` on
        digits and ``epochs=40`` are the same run)."""
        d = {k: v for k, v in self.to_dict().items() if k not in EXECUTION_FIELDS}
        for name, default in OPTIONAL_DEFAULTS.items():
            if d.get(name) == default:
                del d[name]
        d.update(self.hparams())
        d["init"] = self.init.to_dict() if self.init is not None else None
        d.pop("init_params")
        d["data_seed"] = self.seed if self.data_seed is None else self.data_seed
        return d

    @property
    def key(self) -> str:
        """The key (:mod:`structinit.keys`) of :meth:`computed_settings` as canonical JSON."""
        return json_key(self.computed_settings(), default=str)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))


def flat_settings() -> Dict[str, Any]:
    """Every setting of the flat form (:meth:`TrainConfig.to_dict`, grid files, the options of
    ``structinit train``) with its type hint, in :meth:`~TrainConfig.to_dict`'s order."""
    return dict(_flat_settings())


@functools.lru_cache(maxsize=None)
def _flat_settings() -> Dict[str, Any]:
    nested = typing.get_type_hints(TrainConfig)
    model = typing.get_type_hints(ModelConfig)
    hints = {"model": str, "init": Optional[str], "init_params": Dict[str, Any]}
    return {name: hints.get(name) or model.get(name) or nested[name] for name in TrainConfig().to_dict()}


def _model_config(model: Any, settings: Dict[str, Any]) -> ModelConfig:
    """``model`` (a :class:`ModelConfig` or a preset's name) with the model ``settings`` given beside it."""
    if isinstance(model, ModelConfig):
        return dataclasses.replace(model, **settings) if settings else model
    return ModelConfig(name=model, **settings)


def _init_spec(init: Any, params: Optional[Dict[str, Any]], spelling: Optional[Tuple[InitSpec, Dict[str, Any]]]
               ) -> Tuple[Optional[InitSpec], Optional[Tuple[InitSpec, Dict[str, Any]]]]:
    """``(spec, spelling)`` of ``init`` (``None``, a method's name or an :class:`InitSpec`) and the
    ``params`` given with it; ``spelling`` (the config's ``init_spelling``) is kept while it spells
    the spec."""
    if init is None:
        if params:
            raise UsageError(f"{param('init_params')} needs {param('init')}")
        return None, None
    from structinit.init.registry import init_spec

    if _takes_base(init) and "base" not in (params or {}):  # a model train builds: TRAIN_BASE
        params = {**(params or {}), "base": TRAIN_BASE}
    spec = init_spec(init, **(params or {}))
    if not isinstance(init, InitSpec):
        return spec, (spec, copy.deepcopy(dict(params or {})))
    return spec, spelling if spelling is not None and spelling[0] == spec else None


def _takes_base(init: Any) -> bool:
    """Whether ``init``, given by a method's name, declares a ``base`` parameter
    (:attr:`~structinit.init.base.InitSpec.has_base`: ``impulse``, ``mimetic``, ``conditioned``)."""
    if not isinstance(init, str):
        return False
    from structinit.init.registry import INIT_METHODS

    cls = INIT_METHODS.get(init)
    return cls is not None and cls.has_base


def _changed_params(spec: InitSpec) -> Dict[str, Any]:
    """The parameters of ``spec`` that differ from their defaults: the ``init_params`` that rebuild it."""
    out = {}
    for f in dataclasses.fields(spec):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(spec, f.name)
        if value != default:
            out[f.name] = copy.deepcopy(value)
    return out


def long_warmup(hp: Dict[str, Any]) -> Optional[str]:
    """What is wrong with resolved hyperparameters ``hp`` whose warm-up is as long as the training
    (``None`` when it is shorter): the learning rate never reaches its peak."""
    if float(hp["warmup_epochs"]) < float(hp["epochs"]):
        return None
    return (f"warm up for {float(hp['warmup_epochs']):g} epochs but train for only {hp['epochs']}: the learning rate "
            f"never reaches its peak (set {param('warmup_epochs')} too)")


def _check_hparams(r: Dict[str, Any]) -> None:
    from structinit.training.augment import AUGMENTS

    for key in ("epochs", "batch_size", "eval_every"):
        if not isinstance(r[key], int) or isinstance(r[key], bool) or r[key] < 1:
            raise UsageError(f"{param(key)} must be a positive integer, got {r[key]!r}")
    for key in ("lr", "min_lr", "weight_decay", "warmup_epochs", "opt_eps", "grad_clip", "label_smoothing"):
        if not isinstance(r[key], (int, float)) or isinstance(r[key], bool) or not math.isfinite(r[key]):
            raise UsageError(f"{param(key)} must be a finite number, got {r[key]!r}")
    for key in ("lr", "opt_eps"):
        if not r[key] > 0:
            raise UsageError(f"{param(key)} must be positive, got {r[key]}")
    for key in ("min_lr", "weight_decay", "warmup_epochs", "grad_clip", "randaug_n", "randaug_m"):
        if r[key] < 0:
            raise UsageError(f"{param(key)} must not be negative, got {r[key]}")
    if r["min_lr"] > r["lr"]:
        raise UsageError(f"{param('min_lr')} {r['min_lr']} is above {param('lr')} {r['lr']}")
    if not 0 <= r["label_smoothing"] < 1:
        raise UsageError(f"{param('label_smoothing')} must be in [0, 1), got {r['label_smoothing']}")
    if r["augment"] not in AUGMENTS:
        raise UsageError(f"unknown {param('augment')} {r['augment']!r}; choose one of {', '.join(AUGMENTS)}")
