"""KV cache: in-place writes, growth in chunks, crop, evict, byte accounting, limits."""
from __future__ import annotations

import pytest
import torch

from runtime.cache.kv_cache import KVCache
from runtime.dtypes import parse_cache_dtype
from runtime.errors import CacheLimitError


def _write(cache: KVCache, n: int, start_value: float = 0.0):
    cache.reserve(n)
    vals = torch.arange(n, dtype=torch.float32) + start_value
    k = vals.view(1, 1, n, 1).expand(1, cache.n_kv_heads, n, cache.head_dim).to(cache.dtype)
    for layer in range(cache.n_layers):
        out_k, out_v = cache.update(layer, k, -k)
    cache.advance(n)
    return out_k, out_v


def test_default_model_bytes_per_token():
    cache = KVCache(30, 3, 64, 8192, dtype=torch.float32)
    assert cache.bytes_per_token == 46_080  # 2 x 30 x 3 x 64 x 4
    assert KVCache(30, 3, 64, 8192, dtype=torch.bfloat16).bytes_per_token == 23_040


def test_grows_in_chunks_and_keeps_contents():
    cache = KVCache(2, 2, 4, 100, chunk_tokens=8)
    assert cache.allocated_bytes == 0
    _write(cache, 5)
    assert (cache.length, cache.capacity) == (5, 8)
    assert cache.used_bytes == 5 * cache.bytes_per_token
    assert cache.allocated_bytes == 8 * cache.bytes_per_token
    k, v = _write(cache, 6, start_value=5)  # crosses a chunk boundary: grows to 16
    assert (cache.length, cache.capacity) == (11, 16)
    assert k.shape == (1, 2, 11, 4)
    assert k[0, 0, :, 0].tolist() == list(range(11))
    assert v[0, 1, :, 3].tolist() == [-float(i) for i in range(11)]


def test_capacity_never_passes_max_tokens():
    cache = KVCache(1, 1, 2, 10, chunk_tokens=8)
    _write(cache, 9)
    assert cache.capacity == 10
    _write(cache, 1)
    with pytest.raises(CacheLimitError, match="10 tokens"):
        cache.reserve(1)
    assert cache.length == 10


def test_byte_limit():
    per_token = 2 * 1 * 1 * 2 * 4
    cache = KVCache(1, 1, 2, 1000, limit_bytes=per_token * 5, chunk_tokens=4)
    assert cache.token_limit == 5
    _write(cache, 5)
    assert cache.allocated_bytes <= cache.limit_bytes
    with pytest.raises(CacheLimitError, match="memory limit"):
        cache.reserve(1)
    with pytest.raises(CacheLimitError, match="smaller than one token"):
        KVCache(1, 1, 2, 10, limit_bytes=per_token - 1)


def test_crop_and_rewrite():
    cache = KVCache(1, 1, 1, 32)
    _write(cache, 10)
    cache.crop(4)
    assert cache.length == 4 and cache.used_bytes == 4 * cache.bytes_per_token
    k, _ = _write(cache, 2, start_value=100)
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 100, 101]
    with pytest.raises(ValueError):
        cache.crop(7)


def test_evict_shifts_the_tail_down():
    cache = KVCache(2, 1, 1, 32)
    _write(cache, 10)
    cache.remove_span(2, 5)
    assert cache.length == 7
    assert cache.k[1][0, 0, :7, 0].tolist() == [0, 1, 5, 6, 7, 8, 9]


def test_parse_cache_dtype():
    assert parse_cache_dtype("bf16") is torch.bfloat16
    assert parse_cache_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown cache dtype"):
        parse_cache_dtype("int3")


def test_stats_fields():
    cache = KVCache(2, 1, 4, 16, dtype=torch.float16, limit_bytes=10_000)
    _write(cache, 3)
    assert cache.stats() == {
        "dtype": "float16", "bytes_per_token": 32, "tokens": 3,
        "used_bytes": 96, "allocated_bytes": 16 * 32, "limit_bytes": 10_000,
        "positions": 3, "evicted_tokens": 0, "full_bytes": 96,
        # In the paged pool's pages of 16 tokens (512 bytes here): 3 tokens fill 1, none free.
        "pages": {"page_tokens": 16, "bytes_per_page": 512, "used": 1, "shared": 0, "free": 0},
    }
