"""The block-type table (runtime.weights.quant_types): sizes, dequantization and repacks of
every supported GGUF type, checked against gguf-py's reference (which mirrors ggml's C).
ggml's own decoder and products on the types only ggml runs: test_ggml_types.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from runtime.weights.quant_make import GGUF_QUANTIZES, RANDOM_BLOCKS, quantize, random_blocks
from runtime.weights.quant_types import BLOCK_TYPES, block_type, centred, dequantize, repack_int4

LINEAR = [n for n, t in BLOCK_TYPES.items() if t.linear_codes]
#: Types our own code quantizes (gguf-py's quantizers, our K round-to-nearest): no ggml needed.
OWN = ["F32", *GGUF_QUANTIZES, "Q4_K", "Q5_K", "Q6_K"]


def _ggml_loads() -> bool:
    from runtime.kernels import ggml_ops

    return ggml_ops.available()


def _weights(rows: int = 6, cols: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0, :40] = 0.0  # an all-zero block (scale 0)
    w[1] *= 1e-3  # small magnitudes (scales near float16's subnormals)
    w[2, 7] = 30.0  # an outlier
    return w


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_table_matches_ggml_sizes(name):
    t = BLOCK_TYPES[name]
    assert GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)] == (t.block_size, t.block_bytes)
    assert GGMLQuantizationType(t.ggml_type).name == name
    assert block_type(t.ggml_type) is t is block_type(name)


def test_unknown_type_is_refused_by_name():
    with pytest.raises(KeyError, match="GGUF block type Q8_K is not supported; attnchat runs F32, F16, BF16, Q4_0"):
        block_type(GGMLQuantizationType.Q8_K)
    with pytest.raises(KeyError, match="GGUF block type type 99 is not supported"):
        block_type(99)


@pytest.mark.parametrize("name", [n for n, t in BLOCK_TYPES.items() if t.gguf_decodes])
def test_dequantize_is_bitwise_gguf(name):
    t = BLOCK_TYPES[name]
    w = _weights()
    if name in RANDOM_BLOCKS:  # blocks ggml makes only with an importance matrix
        raw = random_blocks(t, *w.shape)
    elif name in OWN or _ggml_loads():
        raw = quantize(w, t)
    else:
        pytest.skip(f"{name} is quantized by ggml, which does not load here")
    if name in GGUF_QUANTIZES:
        ref_blocks = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType(t.ggml_type))).view(np.uint8)
        assert np.array_equal(raw, ref_blocks.reshape(raw.shape)), "quantize must be gguf's own for this type"
    assert raw.shape == (w.shape[0], t.row_bytes(w.shape[1]))
    ref = quants.dequantize(raw if t.quantized else raw.view({"F32": np.float32, "F16": np.float16}.get(name, np.uint8)),
                            GGMLQuantizationType(t.ggml_type))
    ours = dequantize(torch.from_numpy(raw), t).numpy()
    assert ours.shape == w.shape
    np.testing.assert_array_equal(ours, ref.reshape(w.shape))


#: Relative RMS error of our round-to-nearest K quantizers on N(0, 1) weights (measured:
#: Q4_K 0.078, Q5_K 0.039, Q6_K 0.019; gguf's Q4_1 0.078, Q5_1 0.038, Q8_0 0.005).
K_QUANT_ERROR = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025}


@pytest.mark.parametrize("name", list(K_QUANT_ERROR))
def test_our_k_quantizers_are_faithful(name):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 1024)).astype(np.float32)
    back = dequantize(torch.from_numpy(quantize(w, BLOCK_TYPES[name])), BLOCK_TYPES[name]).numpy()
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < K_QUANT_ERROR[name]


@pytest.mark.parametrize("name", LINEAR)
def test_centred_groups_equal_the_dequantized_weights(name):
    """w = scale * code + offset per group: the offset folds the type's zero and minimum in,
    so it may round differently from gguf's order of operations: measured at most 1 ulp of
    the group's largest magnitude; bound 2^-22 relative to it."""
    t = BLOCK_TYPES[name]
    w = _weights()
    raw = torch.from_numpy(quantize(w, t))
    codes, scale, offset = centred(raw, t)
    assert codes.dtype == torch.int8 and codes.shape == w.shape
    assert scale.shape == (w.shape[0], w.shape[1] // t.group)
    if t.name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K"):
        assert offset is None  # symmetric types need no offset
    lo, hi = -(1 << (t.bits - 1)), (1 << (t.bits - 1)) - 1
    if name != "Q8_0":
        assert lo <= int(codes.min()) and int(codes.max()) <= hi
    back = codes.float().view(w.shape[0], -1, t.group) * scale.unsqueeze(-1)
    if offset is not None:
        back = back + offset.unsqueeze(-1)
    ref = dequantize(raw, t).view_as(back)
    bound = ref.abs().amax(dim=-1, keepdim=True) * 2.0**-22
    assert ((back - ref).abs() <= bound).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_repack_for_the_cpu_kernel(name):
    """torch's int4pack (CPU) on the repacked blocks equals the dequantized product up to
    the rounding of the activations and of the scales/zeros to bfloat16: measured relative
    error 0.29 % (0.03 % with float16 scales, 0 with float32)."""
    t = BLOCK_TYPES[name]
    w = _weights(64, 512)
    raw = torch.from_numpy(quantize(w, t))
    W = dequantize(raw, t).double()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ W.T
    for dtype, bound in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        packed, sz = repack_int4(raw, t, dtype=dtype)
        assert sz.shape == (512 // 32, 64, 2) and sz.dtype == dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, sz).double()
        assert ((y - ref).norm() / ref.norm()).item() < bound, dtype


def test_int4_repack_refuses_other_types():
    for name in ("Q5_0", "Q8_0", "Q6_K", "F16", "IQ4_NL", "MXFP4", "IQ4_XS"):
        with pytest.raises(ValueError):
            repack_int4(torch.zeros(1, BLOCK_TYPES[name].row_bytes(256), dtype=torch.uint8), BLOCK_TYPES[name])
