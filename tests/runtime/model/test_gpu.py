"""CUDA: the same model on the GPU agrees with the CPU and with itself across decode modes
(skipped without CUDA; `make gpu-check` runs these checks and the GPU benchmark)."""
from __future__ import annotations

import pytest
import torch

from attnchat.bench import gpu_check
from runtime import load_model
from runtime.generate.chat_format import Message, encode_messages

pytestmark = pytest.mark.gpu


def test_attention_fast_path_on_cuda_matches_reference():
    assert gpu_check.check_attention("cuda")


def test_every_dtype_decodes_and_the_graph_equals_eager(default_model_file):
    """float32, float16 and bfloat16: cached steps = full forward, graph step = eager step."""
    assert gpu_check.check_model(default_model_file, False, "cuda")


def test_default_model_on_cuda_float32_matches_cpu(default_model, default_model_file):
    gpu = load_model(default_model_file, device="cuda", dtype="float32")
    ids = encode_messages(gpu.tokenizer, [Message("user", "What is the capital of France?")])
    cpu_logits = default_model.logits(ids)
    gpu_logits = gpu.logits(ids).cpu()
    # TF32 matmuls may be enabled by the user; 1e-2 covers them.
    assert (gpu_logits - cpu_logits).abs().max().item() < 1e-2
    assert torch.equal(gpu_logits.argmax(-1), cpu_logits.argmax(-1))


def test_default_dtype_on_cuda_answers_paris(default_model_file):
    assert gpu_check.check_paris(default_model_file, False, "cuda")
