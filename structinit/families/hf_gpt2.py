"""The Hugging Face GPT-2 family (the ``hf-gpt2`` layout, a causal decoder whose ``Conv1D``
weights are stored ``[in, out]``): a model of token ids ``[B, L]`` as BERT-style encoders are
(:mod:`structinit.families.hf_bert`), built from its ``config.json``.
"""

from __future__ import annotations

from structinit.families.hf_bert import HfBert
from structinit.init.family import register_family


@register_family
class HfGpt2(HfBert):
    """Hugging Face GPT-2 (see the module docstring)."""

    name = "hf-gpt2"


__all__ = ["HfGpt2"]
