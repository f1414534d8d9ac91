"""The block types only ggml's kernels run (Q2_K, Q3_K, the IQ codebooks, TQ, MXFP4, NVFP4,
Q1_0): the table holds every type ggml-python's ggml computes, ggml's ``to_float`` is bitwise
``gguf.quants.dequantize`` on blocks from ggml's own quantizer and on random well-formed ones,
and ggml's ``mul_mat`` on the raw blocks equals the float64 product of those weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from runtime.kernels import ggml_ops
from runtime.kernels.quantized import candidates, quant_linear, widen
from runtime.weights.quant_make import F16_SCALES, RANDOM_BLOCKS, quantize, random_blocks
from runtime.weights.quant_types import BLOCK_TYPES, dequantize
from runtime.weights.quant_weight import QuantWeight

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")

#: The types without linear codes: ggml's kernels or a widened copy run them.
GGML_ONLY = [n for n, t in BLOCK_TYPES.items() if t.quantized and not t.linear_codes]
#: Activation-only types ggml has (its products' ``vec_dot_type``s), never a weight's.
ACTIVATION_TYPES = ("Q8_1", "Q8_K")


def test_the_table_holds_every_type_ggml_computes():
    """Every type gguf sizes whose ggml traits have a decoder and a dot product is a row, with
    ggml's block size and bytes; the ones left out are activation or integer types."""
    import ggml

    computes = set()
    for qtype, (block, nbytes) in GGML_QUANT_SIZES.items():
        traits = ggml.ggml_get_type_traits(int(qtype)).contents
        cpu = ggml.ggml_get_type_traits_cpu(int(qtype)).contents
        if (traits.to_float or qtype.name == "F32") and cpu.vec_dot and qtype.name not in ACTIVATION_TYPES:
            computes.add(qtype.name)
            assert (traits.blck_size, traits.type_size) == (block, nbytes), qtype.name
    assert computes == set(BLOCK_TYPES)
    assert {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
            "TQ1_0", "TQ2_0", "MXFP4"} <= set(GGML_ONLY)


def _blocks(name: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """ggml's quantizer's blocks of N(0, 1) weights (random blocks where it needs an importance matrix)."""
    t = BLOCK_TYPES[name]
    if name in RANDOM_BLOCKS:
        return torch.from_numpy(random_blocks(t, rows, cols, seed))
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :64] = 0.0  # an all-zero run (scales of 0)
    return torch.from_numpy(quantize(w, t))


@pytest.mark.parametrize("name", [n for n in GGML_ONLY if BLOCK_TYPES[n].gguf_decodes])
def test_ggml_to_float_is_bitwise_gguf(name):
    t = BLOCK_TYPES[name]
    for raw in (_blocks(name, 4, 512), torch.from_numpy(random_blocks(t, 4, 512, seed=3)) if name in F16_SCALES else None):
        if raw is None:
            continue
        ref = quants.dequantize(raw.numpy(), GGMLQuantizationType(t.ggml_type))
        ours = ggml_ops.to_float(raw, t.ggml_type, torch.empty(4, 512))
        assert np.isfinite(ref).all()
        np.testing.assert_array_equal(ours.numpy(), ref)
        np.testing.assert_array_equal(dequantize(raw, t).numpy(), ref)  # the host decoding: gguf's own
        np.testing.assert_array_equal(widen(QuantWeight(raw, t, 4, 512)).numpy(), ref)


#: Relative RMS error of ggml's quantizers on N(0, 1) weights, measured on 8 x 512 (the AMD
#: EPYC Zen 4): Q2_K 0.29, Q3_K 0.15, IQ3_XXS 0.21, IQ3_S 0.16, IQ4_NL 0.076, IQ4_XS 0.076,
#: TQ1_0/TQ2_0 0.79 (ternary), MXFP4 0.12, NVFP4 0.095, Q1_0 0.59 (one bit).
QUANT_ERROR = {"Q2_K": 0.33, "Q3_K": 0.18, "IQ3_XXS": 0.25, "IQ3_S": 0.19, "IQ4_NL": 0.09, "IQ4_XS": 0.09,
               "TQ1_0": 0.82, "TQ2_0": 0.82, "MXFP4": 0.14, "NVFP4": 0.11, "Q1_0": 0.62}


@pytest.mark.parametrize("name", list(QUANT_ERROR))
def test_ggml_quantizer_is_faithful(name):
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    t = BLOCK_TYPES[name]
    back = ggml_ops.to_float(torch.from_numpy(quantize(w, t)), t.ggml_type, torch.empty(8, 512)).numpy()
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < QUANT_ERROR[name]


def test_q1_0_decodes_only_through_ggml():
    raw = _blocks("Q1_0", 2, 256)
    with pytest.raises(ValueError, match="Q1_0 blocks decode only through ggml's to_float"):
        dequantize(raw, BLOCK_TYPES["Q1_0"])


@pytest.mark.parametrize("name", GGML_ONLY)
def test_ggml_products_on_the_raw_blocks(name):
    """Decode (1 row) and prefill (5 rows) through ggml's ``mul_mat``, and ``ggml-exact``,
    against float64 on ggml's own decoding of the blocks. ggml rounds the activations per
    block (Q8_K for the 256-weight types, Q8_0 for the others): measured 0.3-1.0 % here."""
    t = BLOCK_TYPES[name]
    raw = _blocks(name, 64, 512, seed=2)
    w = QuantWeight(raw, t, 64, 512)
    W = ggml_ops.to_float(raw, t.ggml_type, torch.empty(64, 512)).double()
    assert candidates(t, "cpu")[:2] == ["ggml", "ggml-exact"]
    assert "int4pack-bf16" not in candidates(t, "cpu")
    for rows in (1, 5):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        ref = x.double() @ W.T
        for kernel, bound in (("ggml", 0.02), ("ggml-exact", 2e-3), ("widen", 1e-5)):
            y = quant_linear(x, w, kernel)
            assert y.shape == (rows, 64)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < bound, f"{kernel} on {name}, {rows} rows: relative error {err:.4f}"
