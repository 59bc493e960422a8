"""The weights of a checkpoint loaded into the model a family built for it: every tensor, or an
error naming the first that does not fit (the fit reads the model as the checkpoint has it)."""

from __future__ import annotations

from typing import Mapping

from structinit.errors import UsageError


def load_weights(model, sd: Mapping, prefix: str, what: str) -> None:
    """Load ``sd`` (its keys less ``prefix``) into ``model``, every tensor: an unexpected or missing
    one is an error naming it."""
    import torch

    state = {k[len(prefix):]: torch.as_tensor(v) for k, v in sd.items() if isinstance(k, str) and k.startswith(prefix)}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # tensors of other shapes: name the first
        mismatch = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc).splitlines()[0])
        raise UsageError(f"the checkpoint's weights do not fit the {what} ({mismatch})") from None
    problems = []
    if result.unexpected_keys:
        problems.append(f"tensors the model does not have: {', '.join(result.unexpected_keys[:5])}")
    if result.missing_keys:
        problems.append(f"tensors the checkpoint lacks: {', '.join(result.missing_keys[:5])}")
    if problems:
        raise UsageError(f"the checkpoint's weights do not fit the {what} ({'; '.join(problems)})")
    model.eval()


__all__ = ["load_weights"]
