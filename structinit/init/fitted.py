"""Fitted artifacts: the impulse data fit's Q/K (:mod:`structinit.init.data_fit`), stored, found and
shared like a solve's.

A fit is determined by what it reads and how it runs, and its artifact's key hashes exactly that
(:func:`fit_identity`): the plain solve's key, a digest of the model weights the batch passes
through on its way to the last fitted layer (patch and position embedding, prefix tokens, every
block before it; not the head), a digest of the batch, the layers fitted, the seed, and every
parameter of the init that changes the result, the data fit's algorithm version included. The
file is ``n{N}-d{D}-h{heads}-f{f}-fit-{key}.safetensors`` in the artifact cache, written
atomically under the key's lock: of many processes fitting the same model to the same batch (the
tasks of a SLURM array that share model seed and data), one fits and the others read its result.
A truncated or corrupt file is reported, removed and fitted again, never loaded.

Example::

    art, cached = load_or_fit(spec, target, plain, images, seed=0)   # the model is not written on a hit
    art.fit["identity"]["weights"]      # sha256:... of the weights the fit read
    art.q.shape                         # [layers, heads, D, d], the fitted Q/K of every layer
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from structinit.errors import ArtifactError, StructinitError, param


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

    from structinit.analysis.capture import _first_input

    ran: List[Any] = []
    handles = [m.register_forward_pre_hook(lambda module, _args: ran.append(module)) for m in model.modules()]
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            _first_input(last, lambda: model(probe))  # stops at ``last``; a model that cannot run is one error
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


def fit_identity(spec, target, plain, data, seed: int) -> Dict[str, Any]:
    """What a fit of ``target`` (an :class:`~structinit.init.target.AttentionTarget` holding a
    model) to ``data`` from the plain artifact ``plain`` depends on (see the module docstring); its
    hash is the fitted artifact's key."""
    from structinit.analysis.capture import projection_module

    model = target.model
    last = projection_module(model, target.det.slots[max(target.layers)].q.key)
    device = next(model.parameters()).device
    fit = {name: getattr(spec, name) for name in ("data_fit", "data_fit_mass", "data_fit_l2", "data_fit_lr",
                                                  "data_fit_norm", "data_fit_samples", "data_fit_version",
                                                  "data_fit_batch", "self_weight", "mimetic_vproj", "alpha2",
                                                  "beta2")}
    fit["calibrated_to"] = spec.calibration_mass()
    return {"plain": plain.key, "depth": target.depth, "layers": list(target.layers), "seed": int(seed),
            "weights": weights_digest(model, data[:1].to(device), last), "batch": batch_digest(data),
            "samples": int(data.shape[0]), "fit": fit}


def fitted_filename(plain, key: str) -> str:
    c = plain.config
    return f"{c.grid.label}-d{c.dim}-h{c.heads}-f{c.filter}-fit-{key}.safetensors"


def load_or_fit(spec, target, plain, data, seed: int = 0, cache_dir=None,
                progress: Optional[Callable[[int, int], None]] = None, log: Optional[Callable[[str], None]] = None,
                source: Optional[str] = None, warn: Optional[Callable[[str], None]] = None) -> Tuple[Any, bool]:
    """``(artifact, cached)``: the fitted artifact of ``spec`` (an impulse spec) for ``target``'s
    model on the batch ``data``, from the cache, or fitted now (writing the fitted layers into the
    model as it goes) and stored. ``source`` says in words where the batch came from (kept in the
    artifact for ``inspect``). ``progress``/``log`` follow the fit (see
    :meth:`~structinit.init.impulse.ImpulseInit.apply`); ``warn(message)`` hears of a corrupt cached
    copy, which is removed and fitted again (default: a :class:`~structinit.errors.StructinitWarning`)."""
    from structinit.solver.artifact import fit_key, write_artifact
    from structinit.solver.cache import check_cache_dir, find_cached, key_lock, user_cache_dir

    check_cache_dir(cache_dir)
    if warn is None:
        def warn(message: str) -> None:
            import warnings

            from structinit.errors import StructinitWarning

            warnings.warn(StructinitWarning(message), stacklevel=2)
    identity = fit_identity(spec, target, plain, data, seed)
    name = fitted_filename(plain, fit_key(identity))
    hit = find_cached(name, cache_dir, warn)
    if hit is not None:
        return hit, True
    folder = user_cache_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StructinitError(f"cannot create the {param('cache_dir')} folder {folder}: {exc.strerror or exc}") \
            from None
    with key_lock(folder, name):
        hit = find_cached(name, cache_dir, warn)  # another process may have fitted it while we waited
        if hit is not None:
            return hit, True
        artifact = run_fit(spec, target, plain, data, seed, identity, progress, log, source)
        try:
            artifact.path = write_artifact(artifact, folder / name)
        except ArtifactError as exc:
            reason = getattr(exc.__context__, "strerror", None) or exc
            raise StructinitError(f"fitted, but cannot write the fitted artifact into the {param('cache_dir')} "
                                  f"{folder}: {reason}; nothing was stored") from None
    return artifact, False


def run_fit(spec, target, plain, data, seed: int, identity: Dict[str, Any], progress=None, log=None,
            source: Optional[str] = None):
    """Fit every selected layer of ``target``'s model, in order (each written before the next is
    captured), and return the fitted :class:`~structinit.solver.artifact.Artifact`."""
    from structinit.analysis.quality import measure
    from structinit.geometry.targets import causal_mask, impulse_columns
    from structinit.init.baselines import generator
    from structinit.init.impulse import _Fitter
    from structinit.init.inject import read_qk
    from structinit.solver.artifact import Artifact

    t, c = target, plain.config
    depth = t.depth
    src = [0 if plain.depth == 1 else i for i in range(depth)]
    q = np.stack([plain.q[s] for s in src]).astype(np.float32)
    k = np.stack([plain.k[s] for s in src]).astype(np.float32)
    offsets = np.stack([plain.offsets[s] for s in src]).astype(np.int32)
    mask = causal_mask(c.grid, c.causal)
    gen = generator(seed + 1)
    fitter = _Fitter(spec, t, data, seed, progress, log)
    start = time.perf_counter()
    for slot in t.slots:
        _, rq, rk = spec.write_layer(t, slot, plain, gen)
        cols = impulse_columns(c.grid, offsets[slot.index], c.padding)
        fitter.fit(slot, rq, rk, cols, mask)
        fq, fk = read_qk(t.sd, slot, t.heads)
        q[slot.index], k[slot.index] = fq.numpy(), fk.numpy()
    inputs = np.stack([plain.layer_input(s) for s in src])
    columns = np.stack([impulse_columns(c.grid, offsets[i], c.padding) for i in range(depth)])
    quality = measure(inputs, q, k, columns, mask)
    device = next(t.model.parameters()).device
    stats = {"layers": quality.to_stats(), "summary": quality.summary(), "seconds": time.perf_counter() - start,
             "device": str(device), "measured_on": "the pseudo input (the fitted Q/K)"}
    report = fitter.report([{"layer": i, "offsets": offsets[i].tolist()} for i in t.layers], c)
    report.update(seconds=round(fitter.seconds, 3), streamed=fitter.streamed, step_images=fitter.step_images)
    return Artifact(config=c, q=q, k=k, offsets=offsets, pseudo_input=plain.pseudo_input,
                    pseudo_input_rest=plain.pseudo_input_rest, stats=stats,
                    fit={"identity": identity, "source": source, "report": report})


__all__ = ["load_or_fit", "run_fit", "fit_identity", "weights_digest", "batch_digest", "modules_run"]
