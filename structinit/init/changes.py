"""What an init changed, read from the tensors themselves: a copy taken before (:func:`snapshot`)
compared with the state dict after (:func:`changed`). A report's list of changed tensors comes
from here, never from a list typed by hand, so it names everything an init wrote whatever the
method (the position subspace's projected writers included).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping


def snapshot(sd: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of every tensor of state dict ``sd`` (name -> tensor), to compare with after."""
    import torch

    return {name: value.detach().clone() for name, value in sd.items() if isinstance(value, torch.Tensor)}


def changed(before: Mapping[str, Any], sd: Mapping[str, Any]) -> List[str]:
    """The names of the tensors of ``sd`` that differ from ``before`` (a :func:`snapshot`): another
    shape, dtype or any value (NaN equal to NaN), or a tensor added or removed; in ``sd``'s order,
    the removed ones last."""
    import torch

    def same(old, new) -> bool:
        if old.shape != new.shape or old.dtype != new.dtype:
            return False
        if torch.equal(old, new):
            return True
        return bool(new.is_floating_point() and ((old == new) | (old.isnan() & new.isnan())).all())

    out = [name for name, value in sd.items() if isinstance(value, torch.Tensor)
           and (name not in before or not same(before[name], value.detach()))]
    out += [name for name in before if name not in sd]
    return out


__all__ = ["snapshot", "changed"]
