"""The keys that name runs and artifacts: the first :data:`KEY_LENGTH` hex digits of the SHA-256 of
a canonical JSON text (sorted keys, no whitespace). A run's key (``TrainConfig.key``), a solve's
(``SolveConfig.key``) and a fit's (``fit_key``) are all made here, so they have one length and one
form."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional

#: Hex digits of a key.
KEY_LENGTH = 12


def canonical_json(obj: Any, default: Optional[Callable[[Any], Any]] = None) -> str:
    """``obj`` as sorted-key, whitespace-free JSON (what a key hashes)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=default)


def text_key(text: str, length: int = KEY_LENGTH) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def json_key(obj: Any, default: Optional[Callable[[Any], Any]] = None) -> str:
    """The key of ``obj``: :func:`text_key` of its :func:`canonical_json`."""
    return text_key(canonical_json(obj, default))


def looks_like_key(name: str) -> bool:
    """Whether ``name`` has a key's form (:data:`KEY_LENGTH` lower-case hex digits)."""
    return len(name) == KEY_LENGTH and all(ch in "0123456789abcdef" for ch in name)


__all__ = ["KEY_LENGTH", "canonical_json", "text_key", "json_key", "looks_like_key"]
