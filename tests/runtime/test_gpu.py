"""CUDA: the same model on the GPU agrees with the CPU (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.attention import attention_fast, attention_reference
from runtime.chat_format import Message, encode_messages

pytestmark = pytest.mark.gpu


def test_attention_fast_path_on_cuda_matches_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 5, 64, generator=g)
    k = torch.randn(2, 3, 12, 64, generator=g)
    v = torch.randn(2, 3, 12, 64, generator=g)
    ref, _ = attention_reference(q, k, v)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        out = attention_fast(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype))
        torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


def test_default_model_on_cuda_float32_matches_cpu(default_model, default_model_file):
    gpu = load_model(default_model_file, device="cuda", dtype="float32")
    ids = encode_messages(gpu.tokenizer, [Message("user", "What is the capital of France?")])
    cpu_logits = default_model.logits(ids)
    gpu_logits = gpu.logits(ids).cpu()
    # TF32 matmuls may be enabled by the user; 1e-2 covers them.
    assert (gpu_logits - cpu_logits).abs().max().item() < 1e-2
    assert torch.equal(gpu_logits.argmax(-1), cpu_logits.argmax(-1))


def test_default_model_on_cuda_bfloat16_answers_paris(default_model_file):
    gpu = load_model(default_model_file, device="cuda")
    assert gpu.dtype in (torch.bfloat16, torch.float16)
    ids = encode_messages(gpu.tokenizer, [Message("user", "What is the capital of France?")])
    cache = gpu.new_cache(128)
    logits = gpu.logits(ids, cache, last_only=True)
    out = []
    for _ in range(16):
        t = int(logits[0, -1].argmax())
        if t in gpu.stop_token_ids:
            break
        out.append(t)
        logits = gpu.logits([t], cache, last_only=True)
    assert "Paris" in gpu.decode(out)
