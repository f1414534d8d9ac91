"""The shape of a GGUF model (layers, heads, context, sliding windows) read from the start
of its file, local or on the Hub (a few ranged reads, never the whole file).

Stdlib only. The memory planner needs layers x KV heads x head dim for the KV cache's bytes
per token; the Hub's model info names the architecture and context but not those, and a
GGUF carries them in its first kilobytes: llama.cpp's converter writes ``general.*``,
then ``ARCH.*`` (block_count, attention.head_count...), then ``tokenizer.*``, so the
walk stops at the first tokenizer key once it has what it needs.

The walk is :class:`models.safety.gguf_scan.MetadataReader`'s, the reader the safety scan and
runtime's tensor reader use (one scalar table, one set of limits), over ranged reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.safety.refused import Refused
from models.safety.shape import check_metadata as check_shape

from ..kv_bytes import bytes_at
from ..safety.gguf_scan import GGUFHeaderError, HeaderStats, MetadataReader, ReadAt

__all__ = ["GGUFMetaError", "GGUFShape", "SUPPORTED_ARCHITECTURES", "read_shape", "shape_from_file"]

#: GGUF ``general.architecture`` values our decoder runs (runtime.config.FAMILIES, by the names
#: llama.cpp writes: Mistral's GGUFs say "llama", Gemma 3's "gemma3"). tests/models/hub checks
#: this table against runtime's.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3",
    "gpt2": "gpt2",
}

BLOCK = 256 << 10
"""Bytes fetched at a time (one ranged request each on the Hub)."""
#: Per-layer arrays (head counts, a sliding-window pattern) kept as lists up to this many items.
KEPT_ARRAY_ITEMS = 4096


class GGUFMetaError(ValueError):
    """Not a GGUF file, truncated, or without the keys the shape needs (one line)."""


@dataclass(frozen=True)
class GGUFShape:
    """What the memory planner needs about a GGUF model.

    Attributes:
        architecture: ``general.architecture`` (llama.cpp's name, e.g. ``"qwen2"``).
        name: ``general.name`` ("" when absent).
        n_layers, n_heads, n_kv_heads, head_dim: the attention's shape (KV heads: the most
            any layer has, for a per-layer list).
        context_length: the longest context it was trained for (tokens).
        windows: per layer its sliding window in tokens, or None (full attention).
    """

    architecture: str
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    windows: tuple[int | None, ...]

    @property
    def supported(self) -> bool:
        """Whether attnchat's decoder runs this architecture."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    def kv_bytes_at(self, tokens: int, elem_bytes: int = 4) -> int:
        """KV-cache bytes at ``tokens`` of context (a sliding layer holds at most its window)."""
        return bytes_at(self.windows, self.n_kv_heads, self.head_dim, elem_bytes, tokens)


def _windows(arch: str, n_layers: int, window: int, context: int, pattern) -> tuple[int | None, ...]:
    """Per-layer windows as transformers sets them for each family (runtime.config._layer_windows)."""
    if not window or window >= context:
        return (None,) * n_layers
    if arch == "gemma2":  # alternating: even layers slide
        return tuple(window if i % 2 == 0 else None for i in range(n_layers))
    if arch == "gemma3":  # five sliding layers, then one full (sliding_window_pattern 6)
        if isinstance(pattern, list) and len(pattern) == n_layers:
            return tuple(window if p else None for p in pattern)
        every = pattern if isinstance(pattern, int) and pattern > 0 else 6
        return tuple(None if (i + 1) % every == 0 else window for i in range(n_layers))
    if arch in ("qwen2", "qwen3"):  # a window in the file is not used unless layer types say so
        return (None,) * n_layers
    return (window,) * n_layers


def _metadata(read_at: ReadAt) -> tuple[dict[str, object], str]:
    """The metadata up to the tokenizer's keys (once the architecture's are read), and the architecture."""
    r = MetadataReader(read_at, None, HeaderStats(), chunk=BLOCK)
    r.preamble()
    meta: dict[str, object] = {}
    arch = ""
    for i in range(r.stats.keys):
        key = r.name(f"metadata key {i}")
        if key.startswith("tokenizer.") and arch and f"{arch}.block_count" in meta:
            break  # the converter writes every ARCH.* key before the tokenizer's
        meta[key] = r.value(r.u32(), f"'{key}'", keep_items=KEPT_ARRAY_ITEMS)
        if key == "general.architecture":
            arch = str(meta[key])
    return meta, arch


def read_shape(read_at: ReadAt) -> GGUFShape:
    """Walk the start of a GGUF file through ``read_at`` and return its shape.

    Raises:
        GGUFMetaError: not GGUF v2/v3, truncated, or missing a key the shape needs.
        OSError: ``read_at`` failed (passed on).
    """
    try:
        meta, arch = _metadata(read_at)
    except GGUFHeaderError as exc:
        raise GGUFMetaError(str(exc)) from None
    if not arch:
        raise GGUFMetaError("its metadata has no general.architecture")
    try:
        check_shape(meta, "")  # the rule every local load runs
    except Refused as e:
        raise GGUFMetaError(str(e)) from None

    def need(name: str):
        if f"{arch}.{name}" not in meta:
            raise GGUFMetaError(f"its metadata has no {arch}.{name}")
        return meta[f"{arch}.{name}"]

    n_layers = int(need("block_count"))
    n_heads_v = need("attention.head_count")
    n_heads = max(n_heads_v) if isinstance(n_heads_v, list) else int(n_heads_v)
    kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    n_kv = max(kv) if isinstance(kv, list) else int(kv)
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = int(need("embedding_length")) // max(n_heads, 1)
    context = int(meta.get(f"{arch}.context_length") or 0)
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    return GGUFShape(
        architecture=arch, name=str(meta.get("general.name") or ""), n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=int(head_dim), context_length=context,
        windows=_windows(arch, n_layers, window, context or (1 << 40), pattern),
    )


def shape_from_file(path) -> GGUFShape:
    """:func:`read_shape` of a local file.

    Raises:
        GGUFMetaError, OSError: see :func:`read_shape`.
    """
    with open(path, "rb") as f:
        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)
        return read_shape(read_at)
