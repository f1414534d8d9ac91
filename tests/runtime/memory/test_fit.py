"""runtime.fit: weights at the file's size plus the planner's KV cache at a context, against free memory."""
from __future__ import annotations

import pytest

import runtime

# Llama 3.2 1B's shape (16 layers, 8 KV heads of 64) and its Q4_K_M file's size in bytes.
SHAPE = dict(layers=16, kv_heads=8, head_dim=64)
FILE = 807_694_464
KV_8K = 2 * 16 * 8 * 64 * 4 * 8192      # float32 K and V at 8,192 tokens: 536,870,912 bytes


@pytest.mark.parametrize("free, verdict", [
    (2_000_000_000, "fits"),             # 1,344,565,376 bytes take 67 % of it
    (1_600_000_000, "tight"),            # 84 %
    (1_344_565_376, "tight"),            # exactly all of it
    (1_300_000_000, "does not fit"),
])
def test_verdicts(free, verdict):
    f = runtime.fit(FILE, **SHAPE, context=8192, device="cpu", free_bytes=free)
    assert (f.verdict, f.weights_bytes, f.kv_bytes, f.total_bytes, f.free_bytes) == (
        verdict, FILE, KV_8K, FILE + KV_8K, free)
    assert (f.context, f.device, f.cache_dtype) == (8192, "cpu", "float32")


def test_sliding_windows_and_the_cache_dtype_count():
    # Gemma 3 1B: 26 layers of 1 KV head of 256; 22 of them hold at most 512 tokens.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    f = runtime.fit(1000, layers=26, kv_heads=1, head_dim=256, context=8192, windows=windows, cache_dtype="float16",
                    free_bytes=10**9)
    assert f.kv_bytes == 2 * 256 * 2 * (4 * 8192 + 22 * 512) and f.cache_dtype == "float16"


def test_free_memory_from_the_device_when_not_given():
    f = runtime.fit(FILE, **SHAPE, context=1024, device="cpu")
    assert f.free_bytes == pytest.approx(runtime.free_memory_bytes("cpu"), rel=0.2)
    assert f.verdict in ("fits", "tight", "does not fit")
    assert f.to_dict()["total_bytes"] == FILE + KV_8K // 8
