"""What a fit depends on, and its key.

A fit is determined by what it reads and how it runs, and its artifact's key hashes exactly that
(:func:`fit_identity`): the plain solve's key, a digest of the model weights the inputs pass
through on their way to the last fitted layer (patch and position embedding, prefix tokens, every
block before it; not the head), the inputs (:meth:`~structinit.fit.inputs.FitInputs.identity`),
the layers fitted, the seed, and every setting that changes the result, the algorithm version
included (:meth:`~structinit.fit.settings.FitSettings.identity`).
"""

from __future__ import annotations

import hashlib
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


def weights_digest(model, probe, last) -> str:
    """``sha256:<hex>`` of the parameters and buffers the forward of ``probe`` reads up to module
    ``last`` (see :func:`modules_run`): those of every module that ran, and the model's own
    (a position embedding, a class token), by name."""
    ran = {id(m) for m in modules_run(model, probe, last)}
    h = hashlib.sha256()
    for mod_name, module in model.named_modules():
        if module is not model and id(module) not in ran:
            continue
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            tensor_digest(h, f"{mod_name}.{name}" if mod_name else name, t)
    return "sha256:" + h.hexdigest()


def fit_identity(settings, target: FitTarget, plain, inputs, seed: int) -> Dict[str, Any]:
    """What a fit of ``target``'s model (an :class:`~structinit.init.attention_target.AttentionTarget`) on
    ``inputs`` (:class:`~structinit.fit.inputs.FitInputs`) from the plain artifact ``plain`` with
    ``settings`` depends on (see the module docstring); its hash is the fitted artifact's key."""
    model = target.model
    last = projection_module(model, target.det.slots[max(target.layers)].q.key)
    device = next(model.parameters()).device
    return {"plain": plain.key, "depth": target.depth, "layers": list(target.layers), "seed": int(seed),
            "weights": weights_digest(model, inputs.x[:1].to(device), last), **inputs.identity(),
            "fit": settings.identity()}


__all__ = ["fit_identity", "weights_digest", "batch_digest", "modules_run", "tensor_digest"]
