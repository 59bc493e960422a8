"""The Hugging Face BERT-style family (the ``hf-bert`` layout): encoders of token ids ``[B, L]``,
which noise cannot stand for, so their data fit needs data, and whose token grid is the length of
the inputs given. A model tells its heads through its config; a checkpoint's model is built from
its ``config.json`` (:mod:`structinit.families.hf_common`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from structinit.families.hf_common import HfFamily
from structinit.init.family import InputSpec, register_family

#: What a model of token ids takes.
TOKEN_IDS = InputSpec("token id", None, ids=True)


@register_family
class HfBert(HfFamily):
    """Hugging Face BERT-style encoders (see the module docstring)."""

    name = "hf-bert"
    takes_noise = False

    def input_spec(self, model) -> Optional[InputSpec]:
        return TOKEN_IDS

    def config_inputs(self, cfg: dict, grid, det) -> Tuple[InputSpec, Any]:
        return TOKEN_IDS, grid


__all__ = ["HfBert", "TOKEN_IDS"]
