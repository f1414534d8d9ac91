"""runtime.quant_support: what the Hub browser and ``attnchat models files`` mark each quant with,
the loader's own choice per block type and device (a device by argument: the CPU tests pass "cuda")."""
from __future__ import annotations

import pytest

from runtime import quant_support
from runtime.kernels import ggml_ops


@pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")
@pytest.mark.parametrize("name", ["IQ4_XS", "Q2_K", "IQ1_M", "TQ1_0", "MXFP4", "Q1_0", "Q8_0", "Q4_K"])
def test_every_quantized_type_runs_from_its_blocks_through_ggml_on_the_cpu(name):
    s = quant_support(name, "cpu")
    assert (s.runs, s.kernel, s.why, s.extra_bytes(10**6)) == ("blocks", "ggml", "", 0)


def test_a_gpu_runs_4_bit_linear_codes_from_blocks_and_widens_the_rest():
    assert quant_support("Q4_K", "cuda").to_dict() == {"block_type": "Q4_K", "runs": "blocks", "kernel": "tinygemm int4",
                                                       "bits_per_weight": 4.5, "why": ""}
    s = quant_support("IQ4_XS", "cuda")
    assert (s.runs, s.kernel, s.why) == ("widened", "float16 copy", "no cuda kernel takes IQ4_XS blocks")
    assert s.extra_bytes(4_250_000) == 2 * 8_000_000  # 8 M weights at 4.25 bits, 2 bytes each widened


def test_a_type_attnchat_does_not_run():
    s = quant_support("Q8_K")
    assert (s.runs, s.kernel, s.why) == ("no", "", "attnchat does not run Q8_K blocks")
