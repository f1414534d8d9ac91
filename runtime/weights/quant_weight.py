"""One matrix in its GGUF's own blocks, and the forms kernels take of it, made once.
Must not import Qt, transformers or runtime.kernels (the kernels read this object's
attributes and call :meth:`QuantWeight.form`; the block types stay the weights' business).
"""
from __future__ import annotations

import torch

from runtime.device import on_cpu
from runtime.weights.block_source import BlockSource
from runtime.weights.quant_types import BlockType, dequantize, repack_int4, tinygemm_operands

#: The forms :meth:`QuantWeight.form` makes (what each needs: see there).
FORMS = ("int4-cpu-bfloat16", "int4-cpu-float16", "int4-cuda", "int8-rows")


class QuantWeight:
    """A ``rows x cols`` matrix as blocks of one type.

    Attributes:
        raw: ``uint8 (rows, row bytes)``: the blocks in memory (the file's bytes, read at
            load); after :meth:`drop_blocks`, a fresh copy read from the file on each access
            (:meth:`blocks` reads only the rows asked for).
        btype: its block type (:mod:`runtime.weights.quant_types`).
        rows, cols: the matrix's shape ``(out, in)``.
        prepared: what kernels keep of it (kernel name -> its form), made on first use.
        source: where the blocks lie in the file (:class:`runtime.weights.block_source.BlockSource`),
            or None (blocks made in memory: they cannot be dropped).
    """

    __slots__ = ("_raw", "btype", "rows", "cols", "prepared", "source", "__weakref__")

    def __init__(self, raw: torch.Tensor, btype: BlockType, rows: int, cols: int, source: BlockSource | None = None):
        if tuple(raw.shape) != (rows, btype.row_bytes(cols)):
            raise ValueError(f"{btype.name} blocks {tuple(raw.shape)} do not hold a {rows} x {cols} matrix")
        if source is not None and (source.rows, source.row_bytes) != tuple(raw.shape):
            raise ValueError(f"a source of {source.rows} rows of {source.row_bytes} bytes for blocks {tuple(raw.shape)}")
        self._raw, self.btype, self.rows, self.cols, self.prepared = raw, btype, rows, cols, {}
        self.source = source

    @property
    def raw(self) -> torch.Tensor:
        if self._raw is None:   # dropped: read again (ModelFileChanged when the file changed)
            return self.source.read()
        return self._raw

    @raw.setter
    def raw(self, value: torch.Tensor) -> None:
        self._raw = value

    @property
    def resident(self) -> bool:
        """Whether the blocks are in memory (False after :meth:`drop_blocks`)."""
        return self._raw is not None

    @property
    def device(self) -> torch.device:
        """Where the blocks are (a dropped weight's are read to the CPU)."""
        return torch.device("cpu") if self._raw is None else self._raw.device

    def blocks(self, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks of ``rows`` (a step-1 slice; None: all) as ``uint8 (n, row bytes)``: a view
        of them in memory, or, dropped, read from the file into ``out`` (contiguous ``uint8``
        of at least that many bytes) or a fresh tensor.

        Raises:
            ModelFileChanged: dropped blocks whose file changed since the load.
        """
        if self._raw is not None:
            return self._raw if rows is None else self._raw[rows]
        start, stop, _ = (rows or slice(None)).indices(self.rows)
        return self.source.read(start, stop, out)

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks of rows ``ids`` (int64 ``(n,)``) as ``uint8 (n, row bytes)`` (a lookup's).

        Raises:
            ModelFileChanged: dropped blocks whose file changed since the load.
        """
        return self._raw.index_select(0, ids) if self._raw is not None else self.source.gather(ids)

    def drop_blocks(self) -> int:
        """Let the blocks in memory go, where the file can give them again (:attr:`source`) and
        they are on the CPU: for a form that replaces them (the caller has made it and holds
        no view of the blocks). Returns the bytes let go (0: kept)."""
        if self._raw is None or self.source is None or not on_cpu(self._raw):
            return 0
        n = self._raw.numel()
        self._raw = None
        return n

    def __repr__(self) -> str:
        return f"QuantWeight({self.btype.name}, {self.rows}x{self.cols})"

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def file_bytes(self) -> int:
        """Bytes of the blocks (what the file holds for this matrix), in memory or not."""
        return self.rows * self.btype.row_bytes(self.cols)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the blocks in memory: :attr:`file_bytes`, 0 once dropped."""
        return self.file_bytes if self._raw is not None else 0

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
        raw = self.blocks(rows)
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
