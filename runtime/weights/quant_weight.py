"""One matrix in its GGUF's own blocks, and the forms kernels take of it, made once.
Must not import Qt, transformers or runtime.kernels (the kernels read this object's
attributes and call :meth:`QuantWeight.form`; the block types stay the weights' business).
"""
from __future__ import annotations

import torch

from runtime.weights.quant_types import BlockType, dequantize, repack_int4, tinygemm_operands

#: The forms :meth:`QuantWeight.form` makes (what each needs: see there).
FORMS = ("int4-cpu-bfloat16", "int4-cpu-float16", "int4-cuda", "int8-rows")


class QuantWeight:
    """A ``rows x cols`` matrix as blocks of one type.

    Attributes:
        raw: ``uint8 (rows, row bytes)``, usually a view of the memory-mapped file.
        btype: its block type (:mod:`runtime.weights.quant_types`).
        rows, cols: the matrix's shape ``(out, in)``.
        prepared: what kernels keep of it (kernel name -> its form), made on first use.
    """

    __slots__ = ("raw", "btype", "rows", "cols", "prepared", "__weakref__")

    def __init__(self, raw: torch.Tensor, btype: BlockType, rows: int, cols: int):
        if tuple(raw.shape) != (rows, btype.row_bytes(cols)):
            raise ValueError(f"{btype.name} blocks {tuple(raw.shape)} do not hold a {rows} x {cols} matrix")
        self.raw, self.btype, self.rows, self.cols, self.prepared = raw, btype, rows, cols, {}

    def __repr__(self) -> str:
        return f"QuantWeight({self.btype.name}, {self.rows}x{self.cols})"

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def file_bytes(self) -> int:
        """Bytes of the blocks (what the file holds for this matrix)."""
        return self.raw.numel()

    @property
    def extra_bytes(self) -> int:
        """Bytes kernels made beside the blocks (repacks, widened copies)."""
        total = 0
        for form in self.prepared.values():
            for t in form if isinstance(form, tuple) else (form,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                elif isinstance(getattr(t, "nbytes", None), int):   # memory outside torch (ggml's)
                    total += t.nbytes
        return total

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: slice | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights ``(rows, cols)`` (or a slice of rows) in ``dtype`` (float32 into ``out``
        when given), decoded in torch (:func:`runtime.weights.quant_types.dequantize`)."""
        raw = self.raw if rows is None else self.raw[rows]
        w = dequantize(raw, self.btype, (raw.shape[0], self.cols))
        if out is not None:
            return out.copy_(w) if dtype == torch.float32 else out.copy_(w).to(dtype)
        return w if dtype == torch.float32 else w.to(dtype)

    def decode(self, raw_rows: torch.Tensor) -> torch.Tensor:
        """float32 ``(n, cols)`` of ``raw_rows``, rows of blocks of this matrix's type (a lookup's)."""
        return dequantize(raw_rows, self.btype, (raw_rows.shape[0], self.cols))

    def form(self, name: str, device: str | torch.device = "cpu"):
        """A repacked form of the blocks (not kept here: kernels keep what they use).

        - ``"int4-cpu-bfloat16"`` / ``"int4-cpu-float16"``: ``(packed, scales_and_zeros)`` for
          ``_weight_int4pack_mm_for_cpu`` (4-bit types),
        - ``"int4-cuda"``: the same for tinygemm's ``_weight_int4pack_mm`` on ``device``,
        - ``"int8-rows"``: ``(int8 codes (rows, cols), float32 scale (rows,))`` requantized per
          row for ``_weight_int8pack_mm`` (any type: adds rounding).

        Raises:
            ValueError: a form this type has none of; KeyError: an unknown form.
        """
        if name == "int4-cpu-bfloat16":
            return repack_int4(self.raw, self.btype, dtype=torch.bfloat16)
        if name == "int4-cpu-float16":
            return repack_int4(self.raw, self.btype, dtype=torch.float16)
        if name == "int4-cuda":
            pairs, sz = tinygemm_operands(self.raw, self.btype)
            return torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), 8), sz.to(device)
        if name == "int8-rows":
            W = self.dequantized(torch.float32)
            scale = W.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            codes = torch.round(W / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
            return codes.to(device), scale.to(device)
        raise KeyError(f"unknown form {name!r}; one of {', '.join(FORMS)}")
