"""The GGUF block types attnchat runs, one row of a table each (as ggml's ``type_traits``):
block size, bytes per block, how a block decodes, and what it repacks into for a kernel.
Must not import Qt or transformers.

The table holds every type ggml-python's ggml computes and ``gguf.constants.GGML_QUANT_SIZES``
sizes (the tests check both). Two kinds of quantized type:

- Linear codes (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K): ``w = d * (q - z) + m`` per group of
  weights (``q`` the codes, ``d`` the group's scale, ``z`` the type's fixed zero, ``m`` a
  group minimum for the "_1" and K types), read straight from the block layout of
  ggml-quants.c. From that form come :func:`centred` (signed codes with a scale and an
  offset per group: what an 8-bit-groups kernel takes) and :func:`repack_int4` (4-bit
  types as torch's int4pack operands, exact up to the scale's and zero's rounding to the
  activation dtype: a relative 2^-9 of each in bfloat16; the tests bound it), and a
  decoding in torch ops that runs on any device (a CUDA graph captures it).
- Everything else (Q2_K, Q3_K, the IQ codebooks, TQ1_0/TQ2_0, MXFP4, NVFP4, Q1_0): no
  repack; ggml's ``mul_mat`` takes the raw blocks (as it takes every type), and
  :func:`dequantize` decodes them with ``gguf.quants`` (numpy, on the host; ggml's own
  ``to_float`` where ggml loads: :func:`runtime.kernels.quantized.widen`).

:func:`dequantize` is float32 and bitwise ``gguf.quants.dequantize`` for every type gguf
decodes (the tests check each); Q1_0, which gguf-py does not decode, decodes only through
ggml's ``to_float``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Fields:
    """A tensor's blocks decoded: ``w = d * (q - z) + m`` per group.

    Attributes:
        q: codes ``(blocks, block_size)``, uint8 (int8 for Q8_0).
        d: scales ``(blocks, groups)`` float32.
        m: group offsets ``(blocks, groups)`` float32, or None (symmetric types).
        z: the type's fixed zero (8 for Q4_0, 16 for Q5_0, 32 for Q6_K, 0 otherwise).
    """

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    z: int


@dataclass(frozen=True)
class BlockType:
    """One supported GGUF block type (a row of :data:`BLOCK_TYPES`).

    Attributes:
        name: ggml's name (``"Q4_K"``).
        ggml_type: its id in GGUF files (``gguf.GGMLQuantizationType``).
        block_size: weights per block.
        block_bytes: bytes per block.
        bits: bits per code (16/32 for the float types).
        group: weights per scale (32; 16 for Q6_K; the block for float types).
        fields: blocks ``uint8 (n, block_bytes)`` -> :class:`Fields` for the linear-code types
            (None for float types and for codebook types decoded by ``gguf.quants``).
        float_dtype: the torch dtype of a float type's elements (None for quantized types).
        gguf_decodes: whether ``gguf.quants`` decodes the type (False: only ggml's ``to_float``).
        quantized: derived: not a float type (no ``float_dtype``).
        linear_codes: derived: blocks decode as ``w = d * (q - z) + m`` (:class:`Fields`):
            repackable, and decoded by torch ops on any device.
    """

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int
    bits: int
    group: int
    fields: Callable[[torch.Tensor], Fields] | None = None
    float_dtype: torch.dtype | None = None
    gguf_decodes: bool = True
    # Derived once, as a config's head_dim is: a load asks them of every tensor of a file.
    quantized: bool = field(init=False, repr=False, compare=False)
    linear_codes: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantized", self.float_dtype is None)
        object.__setattr__(self, "linear_codes", self.fields is not None)

    @property
    def bits_per_weight(self) -> float:
        """Bytes per block x 8 / weights per block (4.5 for Q4_0, 4.5 for Q4_K, 8.5 for Q8_0)."""
        return self.block_bytes * 8 / self.block_size

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` weights.

        Raises:
            ValueError: ``n`` is not a whole number of blocks.
        """
        if n % self.block_size:
            raise ValueError(f"a row of {n} weights is not whole {self.name} blocks of {self.block_size}")
        return n // self.block_size * self.block_bytes


# ---- decoding the blocks (layouts: ggml/src/ggml-common.h; arithmetic: gguf/quants.py) --------
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 ``(n, 1)``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(n: int, step: int, like: torch.Tensor) -> torch.Tensor:
    """``0, step, 2 step, ...`` (n of them) as uint8 on ``like``'s device: made by ``arange``
    there, so a CUDA graph can capture the decoding (no host-to-device copy)."""
    return torch.arange(0, n * step, step, dtype=torch.uint8, device=like.device)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Runs of ``run`` bytes -> their low nibbles, then their high nibbles: ``(n, 2 * bytes)``."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, run) >> _shifts(2, 4, qs).view(1, 1, 2, 1)) & 0x0F).reshape(n, -1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit ``j`` (little-endian over the bytes) of ``qh (n, count / 8)`` for ``j < count``: ``(n, count)``."""
    n = qh.shape[0]
    shifts = _shifts(8, 1, qh)
    return ((qh.reshape(n, -1, 1) >> shifts.view(1, 1, 8)) & 1).reshape(n, count)


def _q4_0(b: torch.Tensor) -> Fields:  # d f16 | qs[16]
    return Fields(_nibbles(b[:, 2:], 16), _f16(b, 0), None, 8)


def _q4_1(b: torch.Tensor) -> Fields:  # d f16 | m f16 | qs[16]
    return Fields(_nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2), 0)


def _q5_0(b: torch.Tensor) -> Fields:  # d f16 | qh u32 | qs[16]
    return Fields(_nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 32) << 4), _f16(b, 0), None, 16)


def _q5_1(b: torch.Tensor) -> Fields:  # d f16 | m f16 | qh u32 | qs[16]
    return Fields(_nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2), 0)


def _q8_0(b: torch.Tensor) -> Fields:  # d f16 | qs int8[32]
    return Fields(b[:, 2:].contiguous().view(torch.int8), _f16(b, 0), None, 0)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ``(n, 8)`` each (``get_scale_min_k4``)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4_k(b: torch.Tensor) -> Fields:  # d f16 | dmin f16 | scales[12] | qs[128]
    sc, mn = _k_scales(b[:, 4:16])
    return Fields(_nibbles(b[:, 16:], 32), _f16(b, 0) * sc, -(_f16(b, 2) * mn), 0)


def _q5_k(b: torch.Tensor) -> Fields:  # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    sc, mn = _k_scales(b[:, 4:16])
    n = b.shape[0]
    qh = ((b[:, 16:48].reshape(n, 1, 32) >> _shifts(8, 1, b).view(1, 8, 1)) & 1).reshape(n, QK_K)
    return Fields(_nibbles(b[:, 48:], 32) | (qh << 4), _f16(b, 0) * sc, -(_f16(b, 2) * mn), 0)


def _q6_k(b: torch.Tensor) -> Fields:  # ql[128] | qh[64] | scales int8[16] | d f16
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64)
    qh = ((b[:, 128:192].reshape(n, -1, 1, 32) >> _shifts(4, 2, b).view(1, 1, 4, 1)) & 3).reshape(n, QK_K)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    return Fields(ql | (qh << 4), _f16(b, 208) * scales, None, 32)


def _t(name: str, ggml_type: int, block_size: int, block_bytes: int, bits: int, group: int, fields=None, dtype=None,
       gguf_decodes: bool = True):
    return BlockType(name, ggml_type, block_size, block_bytes, bits, group, fields, dtype, gguf_decodes)


def _coded(name: str, ggml_type: int, block_size: int, block_bytes: int, bits: int, gguf_decodes: bool = True):
    """A type without linear codes: one group per block, ``bits`` its nominal code width."""
    return _t(name, ggml_type, block_size, block_bytes, bits, block_size, gguf_decodes=gguf_decodes)


#: The supported types by name (ids and sizes as ``gguf.constants.GGML_QUANT_SIZES``; the tests check).
BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    _t("F32", 0, 1, 4, 32, 1, dtype=torch.float32),
    _t("F16", 1, 1, 2, 16, 1, dtype=torch.float16),
    _t("BF16", 30, 1, 2, 16, 1, dtype=torch.bfloat16),
    _t("Q4_0", 2, 32, 18, 4, 32, _q4_0),
    _t("Q4_1", 3, 32, 20, 4, 32, _q4_1),
    _t("Q5_0", 6, 32, 22, 5, 32, _q5_0),
    _t("Q5_1", 7, 32, 24, 5, 32, _q5_1),
    _t("Q8_0", 8, 32, 34, 8, 32, _q8_0),
    _t("Q4_K", 12, QK_K, 144, 4, 32, _q4_k),
    _t("Q5_K", 13, QK_K, 176, 5, 32, _q5_k),
    _t("Q6_K", 14, QK_K, 210, 6, 16, _q6_k),
    _coded("Q2_K", 10, QK_K, 84, 2),
    _coded("Q3_K", 11, QK_K, 110, 3),
    _coded("IQ2_XXS", 16, QK_K, 66, 2),
    _coded("IQ2_XS", 17, QK_K, 74, 2),
    _coded("IQ3_XXS", 18, QK_K, 98, 3),
    _coded("IQ1_S", 19, QK_K, 50, 1),
    _coded("IQ4_NL", 20, 32, 18, 4),
    _coded("IQ3_S", 21, QK_K, 110, 3),
    _coded("IQ2_S", 22, QK_K, 82, 2),
    _coded("IQ4_XS", 23, QK_K, 136, 4),
    _coded("IQ1_M", 29, QK_K, 56, 1),
    _coded("TQ1_0", 34, QK_K, 54, 2),
    _coded("TQ2_0", 35, QK_K, 66, 2),
    _coded("MXFP4", 39, 32, 17, 4),
    _coded("NVFP4", 40, 64, 36, 4),
    _coded("Q1_0", 41, 128, 18, 1, gguf_decodes=False),
)}
BY_ID: dict[int, BlockType] = {t.ggml_type: t for t in BLOCK_TYPES.values()}


def block_type(ggml_type: int | str) -> BlockType:
    """The row for a type id or name.

    Raises:
        KeyError: a type attnchat does not run (the message names it and the supported ones).
    """
    t = BLOCK_TYPES.get(ggml_type) if isinstance(ggml_type, str) else BY_ID.get(int(ggml_type))
    if t is None:
        raise KeyError(f"GGUF block type {type_name(ggml_type)} is not supported; attnchat runs {', '.join(BLOCK_TYPES)}")
    return t


def type_name(ggml_type: int | str) -> str:
    """gguf's name for a type id (``"Q8_K"``), or ``"type 99"`` for an id gguf does not know."""
    if isinstance(ggml_type, str):
        return ggml_type
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def _blocks(raw: torch.Tensor, t: BlockType) -> torch.Tensor:
    """``raw uint8 (..., bytes)`` as ``(blocks, block_bytes)``."""
    return raw.reshape(-1, t.block_bytes)


# ---- what the kernels take ------------------------------------------------------------------
def dequantize(raw: torch.Tensor, t: BlockType, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """float32 weights of ``raw`` (``uint8``, whole blocks of type ``t``), shaped ``shape``
    (default: ``raw``'s rows, each widened). Bitwise ``gguf.quants.dequantize``."""
    rows = raw.shape[0] if raw.dim() > 1 else 1
    if shape is None:
        shape = (rows, raw.numel() // rows // t.block_bytes * t.block_size)
    if not t.quantized:
        return raw.contiguous().view(t.float_dtype).to(torch.float32).reshape(shape)
    if not t.linear_codes:
        return _gguf_dequantize(raw, t).reshape(shape)
    f = t.fields(_blocks(raw, t))
    n, G = f.d.shape
    q = f.q.to(torch.int8) if f.z else f.q  # (q - z) in int8, as gguf
    codes = (q - f.z if f.z else q).to(torch.float32).view(n, G, -1)  # (blocks, groups, group)
    w = f.d.unsqueeze(-1) * codes
    if f.m is not None:
        w = w + f.m.unsqueeze(-1)
    return w.reshape(shape)


def _gguf_dequantize(raw: torch.Tensor, t: BlockType) -> torch.Tensor:
    """``gguf.quants.dequantize`` of ``raw``'s blocks, float32 ``(blocks, block_size)`` on ``raw``'s
    device (decoded on the host: numpy).

    Raises:
        ValueError: a type gguf-py does not decode (it needs ggml's ``to_float``).
    """
    if not t.gguf_decodes:
        raise ValueError(f"{t.name} blocks decode only through ggml's to_float (gguf-py has no {t.name} decoder): "
                         "install ggml-python")
    from gguf import GGMLQuantizationType, quants

    blocks = _blocks(raw, t)
    host = blocks.cpu().contiguous().numpy()
    w = torch.from_numpy(quants.dequantize(host, GGMLQuantizationType(t.ggml_type)).reshape(blocks.shape[0], -1))
    return w.to(raw.device)  # the same tensor when raw is on the CPU


def centred(raw: torch.Tensor, t: BlockType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``raw``'s rows as 8-bit groups: ``(codes int8 (rows, in), scale float32 (rows, in / group),
    offset float32 (rows, in / group) or None)`` with ``w = scale * codes + offset`` per group.

    Codes are ``q - 2^(bits - 1)`` (Q8_0: its own signed codes); the offset is the block's
    minimum plus the shifted half-range, so only the "_1" and K types have one.

    Raises:
        ValueError: a type without linear codes (a float type, a codebook type).
    """
    rows = raw.shape[0]
    q, half, scale, offset = _groups(raw, t)
    codes = (q.to(torch.int16) - half).to(torch.int8)  # fits: codes span 2^bits values around 0
    return codes.view(rows, -1), scale, offset


def _groups(raw: torch.Tensor, t: BlockType) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]:
    """``(q (groups, group) the unsigned codes, half, scale (rows, groups), offset (rows, groups)
    or None)`` of :func:`centred`: ``w = scale * (q - half) + offset``."""
    if not t.linear_codes:
        raise ValueError(f"{t.name} has no linear codes")
    rows = raw.shape[0]
    f = t.fields(_blocks(raw, t))
    half = 0 if t.name == "Q8_0" else 1 << (t.bits - 1)
    offset = None
    if half != f.z or f.m is not None:  # w = d (q - z) + m = d c + (m + d (half - z))
        offset = f.d * (half - f.z) + (f.m if f.m is not None else 0)
    return f.q, half, f.d.reshape(rows, -1), None if offset is None else offset.reshape(rows, -1)


INT4_GROUP = 32  # weights per scale in torch's int4pack kernels (what Q4_0/Q4_1/Q4_K have)


def repack_int4(raw: torch.Tensor, t: BlockType, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit type's rows as torch's int4pack operands: ``(packed weight, scales_and_zeros
    (in / 32, rows, 2) dtype)``, ``w = (q4 - 8) * scale + zero`` (tinygemm's convention).

    ``device="cpu"``: ``_convert_weight_to_int4pack_for_cpu`` (for ``_weight_int4pack_mm_for_cpu``);
    ``"cuda"``: ``_convert_weight_to_int4pack`` (for ``_weight_int4pack_mm``), which takes
    the codes two to a byte, the even column in the high nibble. The CUDA repack runs on
    the tensor's device; the packing's layout is the kernel's business.

    Raises:
        ValueError: not a 4-bit type.
    """
    if t.bits != 4 or t.group != INT4_GROUP or not t.linear_codes:
        raise ValueError(f"{t.name} is not a 4-bit type with linear codes in groups of {INT4_GROUP}")
    q, half, scale, offset = _groups(raw, t)   # half = 8: q4 = (q - 8) + 8, the file's own codes
    rows = raw.shape[0]
    zero = torch.zeros_like(scale) if offset is None else offset
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (K/32, rows, 2)
    q4 = q.to(torch.int32).reshape(rows, -1)  # (rows, K) in 0..15
    if device == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, inner_k_tiles)
    else:
        pairs = q4.to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack((pairs[:, ::2] << 4 | pairs[:, 1::2]).contiguous(), inner_k_tiles)
    return packed, scales_and_zeros


def tinygemm_operands(raw: torch.Tensor, t: BlockType) -> tuple[torch.Tensor, torch.Tensor]:
    """What CUDA's ``_convert_weight_to_int4pack`` takes for a 4-bit type's rows: ``(uint8 (rows,
    in / 2)`` codes two to a byte, the even column in the high nibble; ``scales_and_zeros
    bfloat16 (in / 32, rows, 2))`` with ``w = (q4 - 8) * scale + zero`` (tinygemm's
    convention). Runs on the CPU (the tests check it there; the conversion needs CUDA).

    Raises:
        ValueError: not a 4-bit type with groups of 32.
    """
    if t.bits != 4 or t.group != INT4_GROUP or not t.linear_codes:
        raise ValueError(f"{t.name} is not a 4-bit type with linear codes in groups of {INT4_GROUP}")
    codes, scale, offset = centred(raw, t)
    q4 = (codes.to(torch.int16) + 8).to(torch.uint8)  # (rows, in) 0..15
    pairs = (q4[:, ::2] << 4) | q4[:, 1::2]
    zero = torch.zeros_like(scale) if offset is None else offset
    return pairs.contiguous(), torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
