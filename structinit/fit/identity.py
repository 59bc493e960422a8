"""What a fit depends on, and its key.

A fit is determined by what it reads and how it runs, and its artifact's key hashes exactly that
(:func:`fit_identity`): the plain solve's key, a digest of the model weights the inputs pass
through on their way to the last fitted layer (patch and position embedding, prefix tokens, every
block before it; not the head), a digest of what those same modules compute with the weights
(:func:`structure_digest`: their types and hyperparameters, an activation or a LayerNorm's eps,
and a Hugging Face model's config), the inputs (:meth:`~structinit.fit.inputs.FitInputs.identity`),
the layers fitted, the seed, and every setting that changes the result, the algorithm version
included (:meth:`~structinit.fit.settings.FitSettings.identity`).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Dict, List

from structinit.analysis.capture import first_input, projection_module

if TYPE_CHECKING:
    from structinit.fit.layers import FitTarget


def tensor_digest(h, name: str, t) -> None:
    """Feed ``name``, dtype, shape and the bytes of tensor ``t`` (as float32 when floating) into ``h``."""
    t = t.detach().to("cpu")
    if t.is_floating_point():
        t = t.float()
    h.update(f"{name}:{str(t.dtype)}:{list(t.shape)};".encode())
    h.update(t.contiguous().numpy().tobytes())


def batch_digest(x) -> str:
    """``sha256:<hex>`` of a batch of model inputs (float32 bytes and shape)."""
    h = hashlib.sha256()
    tensor_digest(h, "batch", x)
    return "sha256:" + h.hexdigest()


def modules_run(model, probe, last) -> List[Any]:
    """The modules of ``model`` whose forward ran on ``probe`` (one input) up to and including
    module ``last``, where the pass stops (it never reaches what comes after, the head say)."""
    import torch

    ran: List[Any] = []
    handles = [m.register_forward_pre_hook(lambda module, _args: ran.append(module)) for m in model.modules()]
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            first_input(last, lambda: model(probe))  # stops at ``last``; a model that cannot run is one error
    finally:
        model.train(was)
        for handle in handles:
            handle.remove()
    return ran


def weights_digest(model, probe=None, last=None, ran=None) -> str:
    """``sha256:<hex>`` of the parameters and buffers the forward of ``probe`` reads up to module
    ``last`` (see :func:`modules_run`): those of every module that ran, and the model's own
    (a position embedding, a class token), by name. ``ran``: the ids of the modules that ran, when
    already known (``probe`` and ``last`` are then not used)."""
    if ran is None:
        ran = {id(m) for m in modules_run(model, probe, last)}
    h = hashlib.sha256()
    for mod_name, module in model.named_modules():
        if module is not model and id(module) not in ran:
            continue
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            tensor_digest(h, f"{mod_name}.{name}" if mod_name else name, t)
    return "sha256:" + h.hexdigest()


#: Module attributes that say how a forward runs or where a model came from, not what it computes
#: (timm's fused attention kernel, an activation's in-place flag, a Hugging Face model's
#: ``name_or_path``): left out of :func:`structure_digest`, so that machines that pick another
#: kernel, and copies of a model loaded from other folders, share a fit.
EXECUTION_ATTRIBUTES = frozenset({"training", "fused_attn", "inplace", "gradient_checkpointing", "name_or_path"})
#: Hugging Face config entries that name or describe a model rather than change what its layers
#: compute (the head's labels included: the head is never run by the fit).
CONFIG_NAMES = frozenset({"_name_or_path", "transformers_version", "architectures", "id2label", "label2id",
                          "torch_dtype", "dtype", "_attn_implementation", "_attn_implementation_autoset",
                          "use_cache", "return_dict", "output_hidden_states", "output_attentions",
                          "_commit_hash", "tokenizer_class", "problem_type", "finetuning_task"})


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def structure_digest(model, ran) -> str:
    """``sha256:<hex>`` of what the modules ``ran`` (those whose forward the fit's inputs go
    through, see :func:`modules_run`) compute with their weights, which the weights' digest cannot
    tell: the same tensors in a model whose activation is ReLU instead of GELU, or whose LayerNorm
    eps differs, give other layer inputs, so another fit.

    It hashes, for each such module (by name, the model itself included), its class, its
    ``extra_repr()`` (what ``repr(model)`` shows of it: a LayerNorm's eps, a Linear's sizes, an
    activation's ``approximate``) and its own attributes of plain values (timm's ``num_heads`` and
    ``scale``, ``no_embed_class``, a Hugging Face attention's ``scaling``), except those that only
    say how it runs (:data:`EXECUTION_ATTRIBUTES`); and a Hugging Face model's config, as
    ``to_dict()`` gives it, less what only names it (:data:`CONFIG_NAMES`), since its modules read
    some settings from it at each forward. This is general where a list of known hyperparameters
    would not be: any model's modules say what they are in the same way ``repr`` does. What it
    cannot see (a computation in a plain function that a module calls, not stored on it) is a
    change of code, which a new algorithm version covers."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        if module is not model and id(module) not in ran:
            continue
        cls = type(module)
        h.update(f"{name}:{cls.__module__}.{cls.__qualname__}({module.extra_repr()});".encode())
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and key not in EXECUTION_ATTRIBUTES and _plain(value):
                h.update(f"{key}={value!r};".encode())
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if callable(to_dict):
        settings = {k: v for k, v in to_dict().items() if k not in CONFIG_NAMES}
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return "sha256:" + h.hexdigest()


def fit_identity(settings, target: FitTarget, plain, inputs, seed: int) -> Dict[str, Any]:
    """What a fit of ``target``'s model (an :class:`~structinit.init.attention_target.AttentionTarget`) on
    ``inputs`` (:class:`~structinit.fit.inputs.FitInputs`) from the plain artifact ``plain`` with
    ``settings`` depends on (see the module docstring); its hash is the fitted artifact's key."""
    model = target.model
    last = projection_module(model, target.det.slots[max(target.layers)].q.key)
    device = next(model.parameters()).device
    ran = {id(m) for m in modules_run(model, inputs.x[:1].to(device), last)}
    return {"plain": plain.key, "depth": target.depth, "layers": list(target.layers), "seed": int(seed),
            "weights": weights_digest(model, ran=ran), "structure": structure_digest(model, ran),
            **inputs.identity(), "fit": settings.identity()}


def check_fitted_to(art, target: FitTarget, shape) -> None:
    """Refuse (:class:`~structinit.errors.UsageError`) the fitted artifact ``art`` when its fit ran
    through other weights than ``target``'s model has: its Q/K were fitted to what those weights give
    each layer, not to what these give. ``shape``: one input's shape, for a probe of zeros; a model
    whose input shape is not known (``None``: token ids) is not checked."""
    import torch

    from structinit.errors import UsageError, param

    model, identity = target.model, art.fit["identity"]
    if model is None or shape is None:
        return
    last = projection_module(model, target.det.slots[min(max(identity["layers"]), target.depth - 1)].q.key)
    device = next(model.parameters()).device
    here = weights_digest(model, torch.zeros(1, *shape, device=device), last)
    if here != identity.get("weights"):
        raise UsageError(f"the {param('artifact')} {art.path or art.key} was fitted through other weights (digest "
                         f"{str(identity.get('weights'))[7:19]}) than this model's ({here[7:19]}): its Q/K do not "
                         "belong to them; leave artifact out to fit them here")


__all__ = ["check_fitted_to", "fit_identity", "weights_digest", "structure_digest", "batch_digest", "modules_run",
           "tensor_digest"]
