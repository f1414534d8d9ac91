"""Whether a block type runs on a device here, and how: what the Hub browser and ``attnchat
models files`` mark each quant with before its download. Must not import Qt.

The answer is the loader's own choice for that type (the default kernel pair of
:func:`runtime.kernels.quant_choice.kernel_pairs`, the refusals of
:mod:`runtime.weights.gguf.open`), so a file marked "runs" loads as marked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from runtime.kernels import ggml_ops
from runtime.kernels.quant_choice import kernel_pairs
from runtime.weights.quant_types import BLOCK_TYPES

__all__ = ["QuantSupport", "quant_support"]

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
