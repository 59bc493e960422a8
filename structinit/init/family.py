"""Model families as registered adapters: what structinit knows of one kind of model, in one place.

A *family* (:class:`ModelFamily`) is the adapter between structinit and one kind of model (timm
ViTs, Hugging Face ViT/DeiT, BERT-style encoders, GPT-2, ``nn.MultiheadAttention``, structinit's own
models). It owns:

- the checkpoint layouts it recognizes: the rows of :data:`structinit.init.layouts.LAYOUTS` whose
  ``family`` names it, and any row it adds (:attr:`ModelFamily.layouts`, tried before the built-in
  table, so a family can claim checkpoints a generic row such as ``torch-mha`` would otherwise take);
- a model's shape: its token grid and heads (:meth:`~ModelFamily.grid`, :meth:`~ModelFamily.heads`);
- the inputs the data fit runs on (:meth:`~ModelFamily.input_spec`, an :class:`InputSpec`);
- how layer inputs are captured (:meth:`~ModelFamily.blocks`, for :mod:`structinit.analysis.capture`)
  and whether each layer's q and k are linear maps of its input (:meth:`~ModelFamily.qk_not_linear`);
- the shape hints a checkpoint's file or folder gives (:meth:`~ModelFamily.checkpoint_hints`);
- building the model of a checkpoint (:meth:`~ModelFamily.build`, a :class:`CheckpointModel`).

Families register with :func:`register_family` (a class decorator, as init methods register with
``structinit.init.base.register``). The built-in ones are the modules of the ``families`` package,
listed in :data:`BUILTIN_FAMILIES` and loaded by name on the first lookup, as another installed
package's are through the entry-point group :data:`ENTRY_POINT_GROUP`; code outside the families
asks them (:func:`family_for_model`, :func:`family_for_checkpoint`, :func:`family_of_layout`) and
never tests which family it has. A layout row that names a family no one registered is refused when
it is registered (:func:`register_layout`): its checkpoints would have no model to fit through.

Example (a new family: its module and its test)::

    @register_family
    class Encoder(ModelFamily):
        name = "my-encoder"
        layouts = (Layout("my-encoder", ..., family="my-encoder"),)

        def input_spec(self, model):
            return InputSpec("feature vector", (16, 8))
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from structinit.errors import StructinitError, StructinitWarning, UsageError, param
from structinit.geometry.grid import Grid
from structinit.init.layouts import Detected, Layout, add_layout, detect_layout, layout_rows


@dataclass(frozen=True)
class InputSpec:
    """What one input of a model is: ``kind`` in words (``image``, ``sequence``, ``token id``...),
    ``shape`` one input's shape (``(C, H, W)`` images, ``(C, L)`` sequences; ``None`` where the
    length may be anything up to the position table). ``ids``: integer token ids ``[B, L]``, which
    noise cannot stand for and whose length is the token grid; ``images``: a folder of images can be
    read into it; ``squeezed``: a batch may leave out the one channel (``[B, L]`` for ``[B, 1, L]``)."""

    kind: str
    shape: Optional[Tuple[int, ...]] = None
    ids: bool = False
    images: bool = False
    squeezed: bool = False

    @property
    def noise_shape(self) -> Optional[Tuple[int, ...]]:
        """The shape of one Gaussian noise input that stands for real ones, or ``None`` when noise cannot."""
        return None if self.ids else self.shape

    def batch_shape(self, x) -> Tuple[int, ...]:
        """One input's shape of batch ``x`` as the model takes it (its channel put back where left out)."""
        got = tuple(int(s) for s in x.shape[1:])
        return (1, *got) if self.squeezed and len(got) == 1 else got

    def as_model_batch(self, x):
        """``x`` as the model takes it (``[B, L]`` -> ``[B, 1, L]`` where the channel may be left out)."""
        return x.unsqueeze(1) if self.squeezed and x.dim() == 2 else x


@dataclass
class CheckpointModel:
    """A model built for a checkpoint by its family: ``model`` (eval mode, the checkpoint's weights
    loaded), ``how`` (in words), ``inputs`` (:class:`InputSpec`), ``grid``/``heads`` its attention
    shape, ``settings`` a ``structinit train`` checkpoint's
    :class:`~structinit.training.config.TrainConfig`, ``family`` the adapter that built it."""

    model: Any
    how: str
    inputs: InputSpec
    grid: Any = None
    heads: Optional[int] = None
    settings: Any = None
    family: Optional["ModelFamily"] = field(default=None, repr=False)

    @property
    def input_shape(self) -> Optional[Tuple[int, ...]]:
        """One input's shape (``None`` for token ids of any length)."""
        return self.inputs.shape


#: What a family that builds no model says (``nn.MultiheadAttention`` checkpoints, layouts of no family).
CANNOT_BUILD = ("the {layout} checkpoint holds attention weights but no model structinit can build and run real "
                "inputs through (timm ViTs, Hugging Face ViT/DeiT, BERT and GPT-2, and structinit train "
                "checkpoints can)")


class ModelFamily:
    """One family's adapter (see the module docstring). Every method has a default a family overrides
    where it knows better; the defaults are what structinit does with a model it knows nothing of."""

    #: The family's name (what a layout row's ``family`` names).
    name: ClassVar[str] = ""
    #: Layout rows this family adds to the built-in table (tried first).
    layouts: ClassVar[Tuple[Layout, ...]] = ()
    #: Whether :meth:`build` can build the model of a checkpoint.
    builds: ClassVar[bool] = False
    #: Whether Gaussian noise can stand for the model's inputs (not for token ids).
    takes_noise: ClassVar[bool] = True
    #: Whether :meth:`attention_quality` measures the model's attention on inputs.
    measures_attention: ClassVar[bool] = False

    # ---- a model

    def claims_model(self, model) -> bool:
        """Whether this family takes ``model`` before the family of its layout would (structinit's own models)."""
        return False

    def grid(self, model) -> Grid:
        """The model's token grid, or a :class:`UsageError` asking for ``grid``."""
        raise UsageError(f"the model has no patch_embed.grid_size; pass {param('grid')}")

    def heads(self, model) -> int:
        """The model's heads per layer, or a :class:`UsageError` asking for ``heads``."""
        raise UsageError(f"the model has no blocks[0].attn.num_heads; pass {param('heads')}")

    def input_spec(self, model) -> Optional[InputSpec]:
        """What one input of ``model`` is, or ``None`` when the model does not tell."""
        return None

    def blocks(self, model) -> Optional[Sequence[Any]]:
        """The model's blocks in the order its forward runs them (one per attention layer), which
        capture streams the residual stream through; ``None``: the model is run up to each layer."""
        return None

    def qk_not_linear(self, model, owner, layer: int) -> Optional[str]:
        """Why layer ``layer``'s q and k are not linear maps of its input (``owner``: the module that
        projects it), in words, or ``None``."""
        if any(type(getattr(owner, n, None)).__name__ not in ("Identity", "NoneType") for n in ("q_norm", "k_norm")):
            return f"layer {layer} normalizes them (q_norm/k_norm)"
        return None

    def attention_quality(self, model, x, offsets, grid, layers: List[int]) -> Dict[str, Any]:
        """The model's attention on batch ``x`` against ``offsets``, per layer (what ``inspect`` shows
        as ``on_inputs``), where :attr:`measures_attention`."""
        raise StructinitError("the attention of this model is measured on its position embedding only")

    # ---- a checkpoint

    def claims_checkpoint(self, ckpt) -> bool:
        """Whether this family takes checkpoint ``ckpt`` before the family of its layout would."""
        return False

    def checkpoint_hints(self, ckpt) -> None:
        """Set ``ckpt.detected``'s heads (and notes) from what the file or its folder tells."""

    def heads_needed(self, det: Detected) -> Optional[str]:
        """What ``apply`` says when a checkpoint to be fitted does not tell its heads (``None``: the
        common refusal)."""
        return None

    def unavailable(self) -> Optional[str]:
        """Why the family cannot build models here (a library not installed), in words, or ``None``."""
        return None

    def build(self, ckpt, sd, *, model_name: Optional[str] = None, config: Optional[str] = None,
              heads: Optional[int] = None, grid=None) -> CheckpointModel:
        """The model of checkpoint ``ckpt`` with ``sd`` loaded (``model_name`` a timm model, ``config``
        a Hugging Face config.json: each refused by a family that does not read it)."""
        self.refuse_config(ckpt, config)
        raise UsageError(CANNOT_BUILD.format(layout=ckpt.detected.layout.name))

    def refuse_config(self, ckpt, config: Optional[str]) -> None:
        """Refuse ``config`` for a checkpoint that is not a Hugging Face model."""
        if config is not None:
            raise UsageError(f"{param('config')} is a Hugging Face config.json; the {ckpt.detected.layout.name} "
                             "checkpoint is not a Hugging Face model")


#: The adapter of a model or layout no registered family claims: structinit's defaults.
GENERIC = ModelFamily()

#: Registered families: name -> adapter (the built-in ones, then any registered later).
FAMILIES: Dict[str, ModelFamily] = {}

#: The modules of the built-in families, loaded by name on the first lookup (each registers its own).
BUILTIN_FAMILIES = ("structinit.families.structinit_models", "structinit.families.timm_vit",
                    "structinit.families.hf_vit", "structinit.families.hf_bert", "structinit.families.hf_gpt2",
                    "structinit.families.torch_mha")

#: The entry-point group through which another installed package adds families: each entry point
#: names a module whose import registers its family with :func:`register_family`.
ENTRY_POINT_GROUP = "structinit.families"

#: Families of other packages that failed to load, in words.
PLUGIN_FAILURES: List[str] = []
_loaded = False

F = TypeVar("F", bound=Type[ModelFamily])


def register_layout(row: Layout) -> None:
    """Add layout ``row`` (tried before the built-in table); refused when its ``family`` names no
    registered family, whose model would be missing when ``apply`` fits through it."""
    if row.family is not None and row.family not in FAMILIES:
        known = ", ".join(FAMILIES) or "none"
        raise StructinitError(f"layout {row.name} names family {row.family!r}, which is not registered "
                              f"(registered: {known}); register the family first")
    if any(r.name == row.name for r in layout_rows()):
        raise StructinitError(f"layout {row.name} is already registered")
    add_layout(row)


def register_family(cls: F) -> F:
    """Class decorator: register family ``cls`` under its ``name``, then its own layout rows."""
    if not cls.name:
        raise StructinitError(f"family {cls.__name__} has no name")
    if cls.name in FAMILIES:
        raise StructinitError(f"family {cls.name} is already registered")
    FAMILIES[cls.name] = cls()
    try:
        for row in cls.layouts:
            register_layout(row)
    except StructinitError:
        del FAMILIES[cls.name]
        raise
    return cls


def load_families() -> None:
    """Import the built-in families and those of :data:`ENTRY_POINT_GROUP` (once); another
    package's family that fails to load is left out, never breaking the built-in ones, and named in
    a warning (and in :data:`PLUGIN_FAILURES`), which the caller shows its way."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in BUILTIN_FAMILIES:
        importlib.import_module(name)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - another package's failure is reported, not raised
            PLUGIN_FAILURES.append(f"family plugin {ep.name} ({ep.value}) was not loaded: {type(exc).__name__}: {exc}")
            warnings.warn(StructinitWarning(PLUGIN_FAILURES[-1]), stacklevel=2)


def family_of_layout(layout: Layout) -> ModelFamily:
    """The family that owns ``layout`` (:data:`GENERIC` for a row of no family)."""
    load_families()
    return FAMILIES.get(layout.family, GENERIC) if layout.family is not None else GENERIC


def family_for_model(model, det: Optional[Detected] = None) -> ModelFamily:
    """The family of ``model`` (``det``: its detected layout, found here when not given)."""
    load_families()
    for family in FAMILIES.values():
        if family.claims_model(model):
            return family
    det = det if det is not None else detect_layout(model.state_dict())
    return family_of_layout(det.layout) if det is not None else GENERIC


def family_for_checkpoint(ckpt) -> ModelFamily:
    """The family of checkpoint ``ckpt`` (a :class:`~structinit.init.checkpoints.Checkpoint`)."""
    load_families()
    for family in FAMILIES.values():
        if family.claims_checkpoint(ckpt):
            return family
    return family_of_layout(ckpt.detected.layout)


def model_grid(model) -> Grid:
    """The token grid of ``model``, as its family tells it."""
    return family_for_model(model).grid(model)


def model_heads(model) -> int:
    """The heads per layer of ``model``, as its family tells them."""
    return family_for_model(model).heads(model)


def model_inputs(model) -> Optional[InputSpec]:
    """What one input of ``model`` is, as its family tells it (``None`` when it does not)."""
    return family_for_model(model).input_spec(model)


__all__ = ["ModelFamily", "InputSpec", "CheckpointModel", "register_family", "register_layout", "FAMILIES",
           "GENERIC", "BUILTIN_FAMILIES", "ENTRY_POINT_GROUP", "load_families", "family_of_layout",
           "family_for_model", "family_for_checkpoint", "model_grid", "model_heads", "model_inputs", "CANNOT_BUILD"]
