"""Making a type's blocks from float weights: for the tests and for random-weight files
(:mod:`runtime.weights.gguf.write`), never to publish a model. Must not import Qt,
transformers or runtime.kernels (ggml's quantizer is called through ggml-python here).

- F32/F16/BF16, Q4_0 ... Q8_0: ``gguf.quants.quantize`` (bitwise ggml's reference quantizers).
- Q4_K, Q5_K, Q6_K: a plain round-to-nearest of our own with the types' layouts (the tiny
  test files were made with it before ggml was a dependency; their answers are pinned).
- Every other type: ggml's own ``ggml_quantize_chunk``; the three types ggml will not
  quantize without an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) get a uniform one.
- :func:`random_blocks`: well-formed random blocks of a type (random bits, finite scales),
  for checking a decoder on bit patterns no quantizer makes, and what random-weight files
  hold for :data:`RANDOM_BLOCKS` (:func:`random_weight_blocks`).
"""
from __future__ import annotations

import ctypes

import numpy as np

from runtime.weights.quant_types import QK_K, BlockType

#: Types quantized by our own round-to-nearest (see the module's docstring).
OWN_K = ("Q4_K", "Q5_K", "Q6_K")
#: Types gguf-py quantizes (bitwise ggml's reference quantizers).
GGUF_QUANTIZES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def quantize(w: np.ndarray, t: BlockType) -> np.ndarray:
    """``w float32 (rows, in)`` as type ``t``'s blocks, ``uint8 (rows, bytes per row)``
    (the quantizer per type: see the module's docstring).

    Raises:
        ValueError: rows that are not whole blocks; RuntimeError: a type only ggml quantizes,
            without ggml-python.
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % t.block_size:
        raise ValueError(f"rows of {w.shape[-1]} weights are not whole {t.name} blocks of {t.block_size}")
    if t.name in OWN_K:
        return _quantize_k(w, t)
    if t.name == "F32":
        return w.view(np.uint8).reshape(w.shape[0], -1)
    if t.name in GGUF_QUANTIZES:
        from gguf import GGMLQuantizationType, quants

        out = quants.quantize(w, GGMLQuantizationType(t.ggml_type))
        return np.ascontiguousarray(out).view(np.uint8).reshape(w.shape[0], -1)
    return ggml_quantize(w, t)


def ggml_quantize(w: np.ndarray, t: BlockType) -> np.ndarray:
    """ggml's ``ggml_quantize_chunk`` of ``w float32 (rows, in)`` -> ``uint8 (rows, row bytes)``
    (a uniform importance matrix where ggml asks for one).

    Raises:
        RuntimeError: ggml-python is not installed or does not load.
    """
    try:
        import ggml
    except (ImportError, OSError) as e:
        raise RuntimeError(f"quantizing to {t.name} needs ggml-python ({type(e).__name__}: {e})") from None
    ggml.ggml_cpu_init()
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    out = np.zeros((rows, t.row_bytes(cols)), dtype=np.uint8)
    imatrix = np.ones(cols, dtype=np.float32) if ggml.ggml_quantize_requires_imatrix(t.ggml_type) else None
    floats = ctypes.POINTER(ctypes.c_float)
    written = ggml.ggml_quantize_chunk(t.ggml_type, w.ctypes.data_as(floats), out.ctypes.data, 0, rows, cols,
                                       None if imatrix is None else imatrix.ctypes.data_as(floats))
    if written != out.nbytes:
        raise RuntimeError(f"ggml wrote {written} bytes of {t.name} blocks where {out.nbytes} are due")
    return out


#: Byte offsets of each type's float16 scales in its block (ggml-common.h's structs), for
#: :func:`random_blocks`: a random float16 there could be an infinity.
F16_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ3_XXS": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ3_S": (0,), "IQ2_S": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


#: Types whose random-weight files hold :func:`random_blocks`: ggml quantizes them only with
#: an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) or after building a search table (IQ1_S's
#: takes 10 s, IQ2_S's 2.3 s, IQ2_XS's 1.3 s on the AMD EPYC Zen 4 at 2 cores, busy): too slow
#: for the tests' tiny files, and the weights are noise either way.
RANDOM_BLOCKS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")


def random_blocks(t: BlockType, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """``uint8 (rows, row bytes)`` of random bits with each float16 scale set to a random
    value in ``[scale / 2, scale)`` (every code and grid index these types have is valid;
    only a scale could be an infinity or a NaN). IQ1_M's scale is the top nibbles of its
    four 16-bit sub-block scales (``iq1m_scale_t``), set the same way.

    Raises:
        ValueError: a type whose scales are not float16 fields (:data:`F16_SCALES`, IQ1_M).
    """
    if t.name not in F16_SCALES and t.name != "IQ1_M":
        raise ValueError(f"{t.name} has no float16 scale to set in random blocks")
    rng = np.random.default_rng(seed)
    n = rows * cols // t.block_size
    blocks = rng.integers(0, 256, size=(n, t.block_bytes), dtype=np.uint8)
    d = rng.uniform(scale / 2, scale, size=(n, 1)).astype(np.float16)
    if t.name == "IQ1_M":  # qs[32] | qh[16] | scales u16[4]: the float16's nibble k tops scales[k]
        bits = d.view(np.uint16)[:, 0]
        sc = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
    for at in F16_SCALES.get(t.name, ()):
        blocks[:, at : at + 2] = d.view(np.uint8)
        d = rng.uniform(scale / 2, scale, size=(n, 1)).astype(np.float16)
    return blocks.reshape(rows, -1)


def random_weight_blocks(t: BlockType, rows: int, cols: int, std: float, seed: int = 0) -> np.ndarray:
    """:func:`random_blocks` whose decoded weights have about ``std`` as their RMS: the scale is
    set from one decoded row of a first draw (``gguf.quants``)."""
    from gguf import GGMLQuantizationType, quants

    probe = random_blocks(t, 1, cols, seed, scale=1.0)
    rms = float(np.sqrt(np.mean(quants.dequantize(probe, GGMLQuantizationType(t.ggml_type)) ** 2)))
    return random_blocks(t, rows, cols, seed, scale=std / rms if rms > 0 else std)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_k(w: np.ndarray, t: BlockType) -> np.ndarray:
    rows = w.shape[0]
    x = w.reshape(-1, QK_K).astype(np.float32)
    n = x.shape[0]
    if t.name == "Q6_K":
        sub = x.reshape(n, 16, 16)
        amax_i = np.abs(sub).argmax(axis=-1)[..., None]
        vmax = np.take_along_axis(sub, amax_i, axis=-1)[..., 0]  # signed max by magnitude
        sub_scale = vmax / -32.0  # (n, 16)
        smax = np.abs(sub_scale).max(axis=-1, keepdims=True)
        d = (smax / 127.0).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            isc = np.where(d > 0, np.clip(np.round(sub_scale / d), -128, 127), 0).astype(np.int8)
            eff = d * isc.astype(np.float32)  # (n, 16)
            q = np.where(eff[..., None] != 0, np.round(sub / eff[..., None]), 0)
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, QK_K)  # 0..63
        # layout: ql[128] holds the low nibbles of q[0:64] | q[64:128] << 4 for each half
        ql = np.zeros((n, 128), np.uint8)
        qh = np.zeros((n, 64), np.uint8)
        for half in range(2):
            base = q[:, half * 128 : half * 128 + 128].reshape(n, 4, 32)  # the 4 runs of 32
            lo = base & 0x0F
            hi = base >> 4
            ql[:, half * 64 : half * 64 + 32] = lo[:, 0] | (lo[:, 2] << 4)
            ql[:, half * 64 + 32 : half * 64 + 64] = lo[:, 1] | (lo[:, 3] << 4)
            qh[:, half * 32 : half * 32 + 32] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
        out = np.concatenate([ql, qh, isc.view(np.uint8), _f16_bytes(d)], axis=1)
        return out.reshape(rows, -1)
    levels = 15 if t.name == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)  # (n, 8): mins are stored as a positive amount subtracted
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    mins = -lo
    d = (scale.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.round(scale / d), 0, 63), 0).astype(np.uint8)
        mn = np.where(dmin > 0, np.clip(np.round(mins / dmin), 0, 63), 0).astype(np.uint8)
        eff_d = d * sc
        eff_m = dmin * mn
        q = np.where(eff_d[..., None] > 0, np.round((sub + eff_m[..., None]) / eff_d[..., None]), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, 4, 2, 32)  # sub-blocks in pairs
    # scales: bytes 0-3 low 6 bits of sc[0:4], 4-7 of mn[0:4], 8-11 the low nibbles of sc[4:8] | mn[4:8] << 4,
    # with the top 2 bits of sc[4:8] / mn[4:8] in bytes 0-3 / 4-7's top bits
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qs = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)  # (n, 4, 32)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if t.name == "Q5_K":
        high = (q >> 4).reshape(n, 8, 32)  # bit i of qh[j] is sub-block i's element j
        qh = np.zeros((n, 32), np.uint8)
        for i in range(8):
            qh |= high[:, i] << i
        parts.append(qh)
    parts.append(qs.reshape(n, 128))
    return np.concatenate(parts, axis=1).reshape(rows, -1)
