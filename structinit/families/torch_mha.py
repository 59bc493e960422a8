"""The ``nn.MultiheadAttention`` family (the ``torch-mha`` layout): modules found by name wherever
they sit in a model. Their model is the caller's, so structinit builds none for a checkpoint (it
gets the plain solve), and a model gives its grid and heads as arguments: every behaviour is
:class:`~structinit.init.family.ModelFamily`'s default.
"""

from __future__ import annotations

from structinit.init.family import ModelFamily, register_family


@register_family
class TorchMha(ModelFamily):
    """``nn.MultiheadAttention`` (see the module docstring)."""

    name = "torch-mha"


__all__ = ["TorchMha"]
