"""The KV cache refuses to grow past the device's free memory, with a clear message."""
from __future__ import annotations

import pytest
import torch

import runtime.device
from runtime.cache.kv_cache import KVCache
from runtime.errors import CacheLimitError


def test_growth_past_free_memory_is_refused_before_allocating(monkeypatch):
    cache = KVCache(2, 2, 8, 4096, chunk_tokens=256)  # 256 B per token (float32)
    monkeypatch.setattr(runtime.device, "free_memory_bytes", lambda device: 100_000)
    cache.reserve(100)  # 256 tokens x 256 B = 64 KiB: fits
    cache.advance(100)
    # Growing to 512 tokens needs 256 more x 256 B + one layer's old buffers (32 KiB) = 96 KiB: fits.
    cache.reserve(300)
    assert cache.capacity == 512
    with pytest.raises(CacheLimitError, match="lower the context length or use a smaller cache dtype") as e:
        cache.reserve(600)  # 768 tokens: 64 KiB more + 64 KiB of one layer's old buffers: does not
    assert "MiB free" in str(e.value)
    assert (cache.length, cache.capacity) == (100, 512)  # unchanged, still usable
    cache.reserve(50)


def test_unknown_free_memory_does_not_block(monkeypatch):
    monkeypatch.setattr(runtime.device, "free_memory_bytes", lambda device: None)
    cache = KVCache(1, 1, 4, 1024, dtype=torch.float16)
    cache.reserve(600)
    assert cache.capacity == 768


def test_the_real_free_memory_check_passes_small_caches():
    cache = KVCache(2, 2, 8, 1024)
    cache.reserve(10)
    assert cache.capacity == 256


def test_cuda_free_memory_counts_what_the_allocator_holds_unused(monkeypatch):
    """The CUDA branch of the free-memory figure, on the CPU: the driver's free bytes plus
    torch's cached-but-unused bytes (which a new KV buffer takes first)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3_000_000, 10_000_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 700_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 200_000)
    assert runtime.device.free_memory_bytes("cuda") == 3_000_000 + 500_000
    assert runtime.device.free_memory_bytes(torch.device("cuda", 0)) == 3_500_000


def test_a_cuda_query_that_fails_reads_as_unknown(monkeypatch):
    def broken(device=None):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert runtime.device.free_memory_bytes("cuda") is None
