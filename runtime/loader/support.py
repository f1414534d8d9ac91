"""Whether a block type runs on a device here, and how: what the Hub browser and ``attnchat
models files`` mark each quant with before its download, and each file's fit on this machine
with its KV cache in the dtype the loader will give it. Must not import Qt.

The answer is the loader's own choice for that type (the default kernel pair of
:func:`runtime.kernels.quant_choice.kernel_pairs`, the refusals of
:mod:`runtime.weights.gguf.open`), so a file marked "runs" loads as marked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from runtime.kernels import ggml_ops
from runtime.kernels.quant_choice import kernel_pairs
from runtime.loader.load import cache_dtype_for, widens
from runtime.memory import planner
from runtime.weights.gguf.open import types_run_from_blocks
from runtime.weights.quant_types import BLOCK_TYPES

__all__ = ["QuantSupport", "fit", "quant_support", "runs_from_blocks"]

#: What each decode kernel is called where a quant is marked.
KERNEL_NAMES = {"ggml": "ggml", "ggml-exact": "ggml", "ggml-head": "ggml", "int4pack-bf16": "torch int4pack",
                "int4pack-cuda": "tinygemm int4", "widen": "float", "f16": "float16 copy"}


@dataclass(frozen=True)
class QuantSupport:
    """How a block type runs here.

    Attributes:
        block_type: the type's name (``"IQ4_XS"``).
        runs: ``"blocks"`` (from the file's blocks: about the file's size in memory),
            ``"widened"`` (a float16 copy of each matrix beside the blocks: 2 bytes a weight
            more) or ``"no"``.
        kernel: the decode kernel's name (:data:`KERNEL_NAMES`), "" when it does not run.
        bits_per_weight: the type's (``bytes per block x 8 / weights per block``), 0 when unknown.
        why: one line (why it widens or does not run), "" when it runs from its blocks.
    """

    block_type: str
    runs: str
    kernel: str
    bits_per_weight: float
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def extra_bytes(self, file_bytes: int) -> int:
        """Memory beyond ``file_bytes`` a file of this type takes when loaded: its weights
        (about ``file_bytes x 8 / bits_per_weight``) x 2 bytes when widened, else 0."""
        if self.runs != "widened" or not self.bits_per_weight:
            return 0
        return int(file_bytes * 8 / self.bits_per_weight) * 2


def quant_support(block_type: str, device: str | torch.device = "cpu") -> QuantSupport:
    """How a file whose matrices are ``block_type`` runs on ``device`` in this process.

    Never raises: an unknown type is ``runs="no"`` with the reason.
    """
    t = BLOCK_TYPES.get(block_type.upper())
    if t is None:
        return QuantSupport(block_type, "no", "", 0.0, f"attnchat does not run {block_type} blocks")
    bpw = round(t.bits_per_weight, 4)
    if not t.quantized:
        return QuantSupport(t.name, "blocks", "float", bpw)
    why_ggml = None if ggml_ops.available() else ggml_ops.unavailable_reason()
    if not t.gguf_decodes and why_ggml is not None:
        return QuantSupport(t.name, "no", "", bpw, f"only ggml decodes {t.name} and ggml does not load here ({why_ggml})")
    decode, _prefill = kernel_pairs(t, device)[0]
    if decode == "f16":
        kind = torch.device(device).type
        why = (f"no {kind} kernel takes {t.name} blocks" if kind != "cpu" else f"ggml does not load here ({why_ggml})")
        return QuantSupport(t.name, "widened", KERNEL_NAMES[decode], bpw, why)
    return QuantSupport(t.name, "blocks", KERNEL_NAMES.get(decode, decode), bpw)


def runs_from_blocks(block_type: str, architecture: str, *, dtype: str | torch.dtype | None = None,
                     reproducible: bool = False) -> bool:
    """Whether a GGUF of family ``architecture`` whose matrices are mostly ``block_type``
    (``"Q4_K"``, from its quant tag) loads from its own blocks with ``load_model``'s
    ``dtype`` and ``reproducible``: the loader's rule for the file itself
    (:func:`runtime.weights.gguf.open.types_run_from_blocks`), on the one type the tag names."""
    if widens(dtype, reproducible):
        return False
    return types_run_from_blocks(architecture, [BLOCK_TYPES.get(block_type.upper())] if block_type else [])


def fit(file_bytes: int, *, layers: int, kv_heads: int, head_dim: int, context: int,
        windows: Sequence[int | None] | None = None, device: str | torch.device = "cpu",
        cache_dtype: str | torch.dtype | None = None, free_bytes: int | None = None,
        block_type: str = "", architecture: str = "", dtype: str | torch.dtype | None = None,
        reproducible: bool = False) -> planner.Fit:
    """:func:`runtime.memory.planner.fit` of a GGUF of ``file_bytes``, its KV cache planned in
    the dtype the loader gives that file on ``device`` (unless ``cache_dtype`` is given): for a
    quantized file of a family run from its blocks on the CPU, the one timed here for its head
    size (:func:`runtime.loader.load.cache_dtype_for`; :func:`runs_from_blocks`;
    ``block_type`` and ``architecture`` name it, "" when unknown),
    the compute dtype otherwise (float32 on the CPU: a float file, a widened one, reproducible
    replies). ``dtype`` and ``reproducible``: as :func:`runtime.load_model` would be called.

    Raises:
        ValueError: as :func:`runtime.memory.planner.plan`.
    """
    blocks = runs_from_blocks(block_type, architecture, dtype=dtype, reproducible=reproducible)
    widened = dtype if widens(dtype, False) else None   # a float dtype asked: the cache computes as it does
    if cache_dtype is None and blocks:
        cache_dtype = cache_dtype_for(device, torch.float16, blocks=True, head_dim=head_dim)
    return planner.fit(file_bytes, layers=layers, kv_heads=kv_heads, head_dim=head_dim, context=context,
                       windows=windows, device=device, cache_dtype=cache_dtype, free_bytes=free_bytes,
                       blocks=blocks, weights_dtype=widened)
