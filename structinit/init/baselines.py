"""The two baseline inits of the comparison: PyTorch's default (``kaiming``) and timm's (``trunc-normal``).

On a model they reset every ``Linear`` (and, for ``kaiming``, every ``Conv2d``) as the training
baselines do; on a state dict they re-draw only the Q/K rows (and biases) of the selected layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec, register
from structinit.init.report import InitReport


def generator(seed: int):
    """A CPU ``torch.Generator`` seeded with ``seed`` (draws are device independent)."""
    import torch

    return torch.Generator().manual_seed(int(seed))


#: What the weights an init does not write start from (the ``base`` parameter of ``impulse`` and
#: ``mimetic``): ``model``, as the model was built (a timm ViT: Linear weights trunc normal std
#: 0.02, biases zero); ``pytorch``, every module's ``reset_parameters()`` (PyTorch's defaults:
#: Kaiming-uniform Linear and Conv weights, uniform biases), as the authors' released code leaves them;
#: ``pytorch-mlp`` and ``pytorch-head``, only the MLPs' Linear layers or only the classifier, to tell which
#: part of that base matters. Which modules those are, by name (:data:`BASE_PARTS`): the MLPs are the
#: modules under an ``mlp`` (timm's ViTs and structinit's models: ``blocks.i.mlp.fc1``/``fc2``;
#: transformers 5's ViT/DeiT: ``layers.i.mlp.fc1``/``fc2``; transformers 4 names them
#: ``intermediate``/``output`` and gets a refusal, as a base that resets nothing is refused); the
#: classifier is ``head`` (timm, structinit) or ``classifier`` (transformers' ``*ForImageClassification``).
BASES = ("model", "pytorch", "pytorch-mlp", "pytorch-head")
#: The base measured best for a model trained from scratch, chosen on the validation splits of the
#: Fashion-MNIST and digits learning curves: ``structinit train``'s default (``TRAIN_BASE``), and what
#: ``initialize_model`` and ``apply``, which keep the user's weights, say of it (:func:`base_note`).
SCRATCH_BASE = "pytorch-mlp"


def base_note(spec) -> Optional[str]:
    """For an init that keeps the other weights as they are (``base="model"``): the line that says
    which base trained better from scratch (``None`` for any other spec)."""
    if not spec.has_base or spec.other_weights != "model":
        return None
    return (f"the weights {spec.method} does not write are kept as they are ({param('base')}=model); for a model "
            f"trained from scratch {param('base')}={SCRATCH_BASE} (the MLPs at PyTorch's default, structinit train's "
            "default) trained better on Fashion-MNIST and digits")
#: The modules each partial base resets, by their name in the model (see :data:`BASES`).
BASE_PARTS = {"pytorch-mlp": lambda name: ".mlp." in f".{name}.",
              "pytorch-head": lambda name: name in ("head", "classifier")}
#: What each partial base resets, in words (its refusal names it).
BASE_PART_WORDS = {"pytorch-mlp": "the MLPs' Linear layers (modules under an 'mlp': timm's and structinit's ViTs, "
                                  "transformers 5's ViT/DeiT)",
                   "pytorch-head": "the classifier (a module named 'head' or 'classifier')"}


def reset_to_defaults(model, seed: int, only=None) -> List[str]:
    """Call ``reset_parameters()`` on every module of ``model`` that has one (``Linear``, ``Conv``,
    ``LayerNorm``, ...: PyTorch's default init, as a model built with timm's init skipped has it),
    under ``torch.manual_seed(seed)`` in a forked RNG (the global RNG is left as it was); ``only(name)``
    picks the modules (default: all). Returns ``"name (Type)"`` of every module reset, in order."""
    import torch

    done = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for name, module in model.named_modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and (only is None or only(name)):
                reset()
                done.append(f"{name or '<model>'} ({type(module).__name__})")
    return done


def apply_base(target, base: str, seed: int, method: str) -> Optional[int]:
    """Reset ``target``'s model to ``base`` (see :data:`BASES`) before an init writes its part:
    the number of modules reset (``None`` for ``model``, which changes nothing). ``pytorch`` needs a
    model (a state dict has no modules); ``method`` names the init in that error."""
    if base == "model":
        return None
    if target.model is None:
        raise UsageError(f"{method} parameter {param('base')} {base} resets modules of a model; a checkpoint or "
                         "state dict has none (leave base at model)")
    only = BASE_PARTS.get(base)
    if only is not None and not any(only(name) and callable(getattr(m, "reset_parameters", None))
                                    for name, m in target.model.named_modules()):
        raise UsageError(f"{method} parameter {param('base')} {base} resets {BASE_PART_WORDS[base]}; the "
                         f"{type(target.model).__name__} has none, so it would reset nothing (leave base at model)")
    return len(reset_to_defaults(target.model, seed, only))


def redraw_qk(t, method: str, seed: int, std: float = 0.02) -> "InitReport":
    """Re-draw the Q/K rows and biases of ``t``'s selected layers: ``kaiming`` with the bound of a
    ``[D, D]`` Linear, ``trunc-normal`` with ``std`` (biases zero)."""
    import torch

    from structinit.init.inject import label, write_part

    gen = generator(seed)
    replaced = []
    bound = 1.0 / math.sqrt(t.dim)
    for slot in t.slots:
        keys = []
        for w, b in ((slot.q, slot.q_bias), (slot.k, slot.k_bias)):
            if method == "kaiming":
                val = (torch.rand(t.dim, t.dim, generator=gen) * 2 - 1) * bound
                bias = (torch.rand(t.dim, generator=gen) * 2 - 1) * bound
            else:
                val = (torch.randn(t.dim, t.dim, generator=gen) * std).clamp_(-2.0, 2.0)
                bias = torch.zeros(t.dim)
            write_part(t.sd, w, val)
            keys.append(label(w))
            if b is not None:
                write_part(t.sd, b, bias)
                keys.append(label(b))
        replaced.append({"layer": slot.index, "replaced": keys})
    return InitReport.from_dict({"method": method, "layout": t.layout, "layers": replaced})


@register
@dataclass(frozen=True)
class KaimingInit(InitSpec):
    """PyTorch's default init: ``kaiming_uniform_(a=sqrt(5))`` weights, biases ``U(+-1/sqrt(fan_in))``.

    Model: ``reset_parameters()`` of every ``Linear`` and ``Conv2d``. State dict: the Q/K rows
    (and biases) of the selected layers, drawn with the bound of a ``[D, D]`` Linear.
    """

    method = "kaiming"
    writes = "model: every Linear and Conv2d; state dict: Q/K rows and biases"
    fixed_base = "pytorch"

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        import torch

        if target.model is None:
            return redraw_qk(target, "kaiming", seed)
        n = 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in target.model.modules():
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)):
                    m.reset_parameters()
                    n += 1
        return InitReport.from_dict({"method": "kaiming", "modules_reset": n})


@register
@dataclass(frozen=True)
class TruncNormalInit(InitSpec):
    """timm's default ViT init: Linear weights ``trunc_normal_(std)``, biases zero; a learnable
    ``pos_embed`` trunc-normal ``std`` (a frozen one is left alone), ``cls_token`` normal std 1e-6.

    State dict: the Q/K rows of the selected layers, biases zero.
    """

    method = "trunc-normal"
    writes = "model: every Linear, a learnable pos_embed, cls_token; state dict: Q/K rows and biases"
    std: float = 0.02

    def validate(self) -> None:
        self.check_positive("std")

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        import torch

        if target.model is None:
            return redraw_qk(target, "trunc-normal", seed, std=self.std)
        from timm.layers import trunc_normal_

        model = target.model
        n = 0
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            pe = getattr(model, "pos_embed", None)
            if isinstance(pe, torch.nn.Parameter) and pe.requires_grad:
                trunc_normal_(pe, std=self.std)
            cls = getattr(model, "cls_token", None)
            if isinstance(cls, torch.nn.Parameter):
                torch.nn.init.normal_(cls, std=1e-6)
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    trunc_normal_(m.weight, std=self.std)
                    if m.bias is not None:
                        torch.nn.init.zeros_(m.bias)
                    n += 1
        return InitReport.from_dict({"method": "trunc-normal", "std": self.std, "linear_reset": n})
