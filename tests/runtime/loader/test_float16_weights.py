"""float16 weights computing in float32 (runtime.device.compute_dtype): the CPU default
for models in float formats, and ``--dtype float16`` for a quantized GGUF (whose default
is its own blocks: test_gguf_blocks.py), widened from the file's blocks in memory.

Truth is our float32 engine, itself checked against transformers (test_default_model).
The bounds are about 2x what we measured (README, "Weights on the CPU").
"""
from __future__ import annotations

import pytest
import torch

from runtime import compute_dtype, load_model
from runtime.device import default_dtype
from tests.runtime.memory_maps import mapped_files

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model16(default_model_file):
    return load_model(default_model_file, device="cpu", dtype="float16")  # the widened comparison path


@pytest.fixture(scope="module")
def text_ids(default_model):
    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
            "fifty years, presses had spread to more than two hundred European cities, and the "
            "price of books fell sharply. Scholars argue about how much this changed literacy, "
            "religion and science, but few doubt that it changed them. ") * 2
    return default_model.encode(text)


def test_float16_weights_compute_in_float32(model16, default_model):
    assert model16.dtype == torch.float16 and model16.compute_dtype == torch.float32
    assert default_dtype("cpu") == torch.float16  # for models in float formats
    assert model16.decoder.blocks[0].mlp.gate_up_proj.weight.dtype == torch.float16
    assert model16.decoder.blocks[0].attn_norm.weight.dtype == torch.float32
    # Every matrix is float16, widened from the GGUF's blocks in memory: no converted
    # file is mapped (none is written: the GGUF is the weights' cache).
    assert {p.dtype for p in model16.decoder.parameters() if p.dim() == 2} == {torch.float16}
    assert mapped_files(model16) <= {"", "[heap]"}  # anonymous memory only
    # Half the bytes, less the norm weights, which stay float32 (61 x 576 of 134.5M).
    assert model16.weights_bytes * 2 - default_model.weights_bytes == 61 * 576 * 2 * 2
    cache = model16.new_cache(64)
    assert cache.dtype == torch.float32 and cache.bytes_per_token == 46_080
    assert compute_dtype("cpu", "float16") == torch.float32
    assert compute_dtype("cpu", "bfloat16") == compute_dtype("cuda", "bfloat16") == torch.float32
    assert compute_dtype("cuda", "float16") == torch.float16


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def test_prefill_logits_close_to_float32(model16, default_model, text_ids):
    ref = default_model.logits(text_ids)[0]
    ours = model16.logits(text_ids)[0]
    diff = (ours - ref).abs()
    assert diff.mean().item() < 0.01 and diff.max().item() < 0.1
    assert _agreement(ours, ref) >= 0.99


def test_decode_logits_close_to_float32(model16, default_model, text_ids):
    """Token by token (the float16 matrix-vector path), teacher-forced on the same text."""
    ref = default_model.logits(text_ids)[0, 1:]
    cache = model16.new_cache(len(text_ids))
    model16.logits(text_ids[:1], cache)
    steps = torch.stack([model16.logits([t], cache)[0, -1] for t in text_ids[1:]])
    diff = (steps - ref).abs()
    assert diff.mean().item() < 0.02 and diff.max().item() < 0.25
    assert _agreement(steps, ref) >= 0.97
