"""Weights and inputs an init reads must be finite: a NaN or an infinity in a checkpoint (a diverged
run), in a model's weights or in a batch of inputs would make a solve or a fit write NaN into
every layer it touches. :func:`check_finite` refuses them before any work, naming the tensor and
how many of its values are not finite; :func:`check_float_weights` refuses attention weights of
an integer dtype (a quantized checkpoint), which an init cannot write."""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

from structinit.errors import UsageError, param


def nonfinite_text(t: Any) -> str:
    """``""`` when every value of tensor ``t`` is finite (or it is not floating), else how many are
    not, in words: ``"1 inf"``, ``"3 NaN and 2 inf"``."""
    import torch

    t = torch.as_tensor(t)
    if not (t.is_floating_point() or t.is_complex()):
        return ""
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return ""
    nan = int(torch.isnan(t).sum())
    inf = int((~finite).sum()) - nan
    parts = [f"{nan:,} NaN" if nan else "", f"{inf:,} inf" if inf else ""]
    return " and ".join(p for p in parts if p)


def check_finite(named: Iterable[Tuple[str, Any]], where: str) -> None:
    """Raise :class:`UsageError` for the first tensor of ``named`` (``(name, tensor)`` pairs, in
    ``where``, words such as "the checkpoint") holding a value that is not finite; a tensor named
    as a mask may hold ``-inf`` (an attention mask's blocked entries)."""
    import torch

    for name, t in named:
        bad = nonfinite_text(t)
        if bad and "mask" in name.lower() and bad.endswith(" inf") and " NaN" not in bad \
                and not bool((torch.as_tensor(t) == float("inf")).any()):
            continue  # an attention mask's -inf entries (a buffer, not a weight)
        if bad:
            raise UsageError(f"{where}: tensor {name} holds {bad} of its {torch.as_tensor(t).numel():,} values; an "
                             "init reads finite weights only (a diverged run?), and nothing was written")


def check_finite_inputs(x: Any) -> None:
    """Raise :class:`UsageError` when the batch of inputs ``x`` holds a value that is not finite."""
    bad = nonfinite_text(x)
    if bad:
        raise UsageError(f"{param('data')} holds {bad} of its {x.numel():,} values; give finite inputs")


def model_tensors(target: Any) -> Iterable[Tuple[str, Any]]:
    """``(name, tensor)`` of a model's parameters and buffers, or of a state dict's entries."""
    if hasattr(target, "named_parameters"):
        yield from target.named_parameters()
        yield from target.named_buffers()
    else:
        yield from ((k, v) for k, v in target.items() if hasattr(v, "dtype"))


def check_float_weights(named: Iterable[Tuple[str, Any]], where: str) -> None:
    """Raise :class:`UsageError` for the first tensor of ``named`` whose dtype is not floating (an
    int8 checkpoint): an init writes float Q/K, which it cannot store in integers."""
    import torch

    for name, t in named:
        if t is None:
            continue
        t = torch.as_tensor(t)
        if not (t.is_floating_point() or t.is_complex()):
            raise UsageError(f"{where}: tensor {name} is {str(t.dtype).replace('torch.', '')}, not floating point (a "
                             "quantized checkpoint?); an init writes float weights: give the float checkpoint")


def attention_keys(det: Any) -> List[str]:
    """The keys of every tensor an init of the detected layout ``det`` reads or writes: each
    attention layer's Q/K/V rows, biases and output projection, and the position embedding."""
    keys = []
    for slot in det.slots:
        keys += [p.key for p in (slot.q, slot.k, slot.v, slot.q_bias, slot.k_bias, slot.v_bias) if p is not None]
        keys += [slot.proj] if slot.proj else []
    keys += [det.pos_key] if det.pos_key else []
    return list(dict.fromkeys(keys))


__all__ = ["attention_keys", "check_finite_inputs", "check_finite", "check_float_weights", "model_tensors",
           "nonfinite_text"]
