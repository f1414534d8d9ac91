"""The numbers a model's shape is built from, checked before anything divides by them or
sizes memory by them: one rule for a local GGUF's metadata (every load, ``attnchat memory``:
:mod:`runtime.weights.validate`) and a Hub file's header (the fit check:
:func:`models.hub.gguf_meta.read_shape`). Stdlib only.

Each number must be a whole number of at least 1 and at most its limit below (the largest
real models are far inside them: Llama 3.1 405B has 126 layers, 128 heads, hidden 16,384,
feed-forward 53,248; Gemma 3's vocabulary is 262,144 tokens; the longest claimed context
is 10 million), and the query heads a multiple of the key/value heads. Past them, a file
is damaged or made to hurt: ``head_count`` 0 divided by zero, ``block_count`` 1,000,000
planned 500,000 MiB of KV cache.
"""
from __future__ import annotations

from typing import Any, Mapping

from .refused import Refused

__all__ = ["LIMITS", "check_metadata"]

#: ``ARCH.KEY`` -> (the most it may be, what it is, whether a model needs it).
LIMITS: dict[str, tuple[int, str, bool]] = {
    "block_count": (1 << 12, "layers", True),
    "embedding_length": (1 << 17, "the hidden size", True),
    "attention.head_count": (1 << 12, "query heads", True),
    "attention.head_count_kv": (1 << 12, "key/value heads", False),
    "attention.key_length": (1 << 12, "the key head size", False),
    "attention.value_length": (1 << 12, "the value head size", False),
    "feed_forward_length": (1 << 20, "the feed-forward size", False),
    "context_length": (1 << 30, "tokens of context", False),
    "vocab_size": (1 << 23, "tokens", False),
}


def _ints(value: Any) -> list[int] | None:
    """A number, or a per-layer list of them (as gguf_meta keeps short arrays); None for
    anything else (an array the reader kept only as its count)."""
    values = value if isinstance(value, list) else [value]
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return values
    return None


def check_metadata(meta: Mapping[str, Any], name: str) -> None:
    """Refuse a GGUF whose shape numbers (:data:`LIMITS`, under ``general.architecture``'s
    prefix) are missing where a model needs them, below 1, past their limit, or whose query
    heads are not a multiple of its key/value heads. ``name`` names the file in the message.

    Raises:
        Refused: kind ``"shape"``, one line naming the key and its value.
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return  # the loaders refuse a file without an architecture in their own words
    fix = "the file is damaged or not a model attnchat runs: download it again"
    lead = f"{name}: " if name else ""
    for key, (most, what, needed) in LIMITS.items():
        full = f"{arch}.{key}"
        if full not in meta:
            if needed:
                raise Refused(f"{lead}its metadata has no {full} ({what}); {fix}", "shape")
            continue
        values = _ints(meta[full])
        if values is None:
            if isinstance(meta[full], (int, float, str, bool, list)):
                raise Refused(f"{lead}its metadata says {full} = {meta[full]!r}, not a whole number; {fix}", "shape")
            continue
        low, high = min(values), max(values)
        if low < 1 or high > most:
            bad = low if low < 1 else high
            limit = "at least 1" if low < 1 else f"at most {most:,}"
            raise Refused(f"{lead}its metadata says {full} = {bad:,} ({what}; a model has {limit}); {fix}", "shape")
    heads = _ints(meta.get(f"{arch}.attention.head_count"))
    kv = _ints(meta.get(f"{arch}.attention.head_count_kv"))
    if heads and kv and len(heads) == 1 and len(kv) == 1 and heads[0] % kv[0]:
        raise Refused(f"{lead}its metadata gives {heads[0]:,} query heads and {kv[0]:,} key/value heads; the query "
                      f"heads must be a multiple of the key/value heads; {fix}", "shape")
