"""The int8 KV cache (symmetric, one float32 scale per token and KV head): bytes, storage, decoding.

Mechanics on hand-made tensors and a tiny seeded model; quality on the real default
model lives in test_int8_quality.py.
"""
from __future__ import annotations

import pytest
import torch

from runtime import cache_bytes_per_token, load_model, plan
from runtime.cache.kv_cache import KVCache
from runtime.dtypes import parse_cache_dtype, vector_bytes
from runtime.quantize import dequantize_int8, quantize_int8
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model


def test_quantize_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0, 25_000.0, 1.0]).view(1, 1, 5, 1)
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2, 3, 5, 1)
    assert q.abs().max().item() == 127  # each vector's largest number takes the top code
    err = (dequantize_int8(q, s) - x).abs()
    assert (err <= s / 2 + 1e-6 * x.abs()).all()
    zero_q, zero_s = quantize_int8(torch.zeros(1, 1, 2, 8))
    assert zero_q.abs().sum() == 0 and zero_s.abs().sum() == 0
    assert dequantize_int8(zero_q, zero_s).abs().sum() == 0


def test_bytes_per_token_count_the_scales():
    assert vector_bytes("int8", 64) == 68
    cache = KVCache(30, 3, 64, 8192, dtype=torch.int8)
    assert cache.bytes_per_token == 12_240  # 2 x 30 x 3 x (64 + 4)
    assert cache_bytes_per_token(30, 3, 64, "int8") == 12_240
    assert cache_bytes_per_token(30, 3, 64, "float32") == 46_080
    p = plan(layers=30, kv_heads=3, head_dim=64, cache_dtype="int8", context=1000, budget_bytes=12_240 * 10 + 5)
    assert (p.kv_bytes_per_token, p.kv_bytes, p.max_context_in_budget, p.cache_dtype) == (12_240, 12_240_000, 10, "int8")
    assert parse_cache_dtype("int8") is torch.int8


def test_allocated_bytes_are_what_the_buffers_take():
    cache = KVCache(2, 3, 16, 100, dtype=torch.int8, chunk_tokens=8)
    cache.reserve(5)
    buffers = [*cache.k, *cache.v, *cache.k_scale, *cache.v_scale]
    assert sum(b.numel() * b.element_size() for b in buffers) == cache.allocated_bytes == 8 * cache.bytes_per_token
    assert cache.stats()["dtype"] == "int8"


def _fill(cache: KVCache, k: torch.Tensor, v: torch.Tensor):
    cache.reserve(k.shape[2])
    # clone: an int8 cache's reads share one buffer, valid until the next layer's read
    out = [tuple(t.clone() for t in cache.update(layer, k * (layer + 1), v)) for layer in range(cache.n_layers)]
    cache.advance(k.shape[2])
    return out


def test_update_returns_the_dequantized_history_across_growth():
    g = torch.Generator().manual_seed(1)
    cache = KVCache(2, 2, 8, 64, dtype=torch.int8, chunk_tokens=4)
    k1, v1 = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    k2, v2 = torch.randn(1, 2, 6, 8, generator=g) * 50, torch.randn(1, 2, 6, 8, generator=g)
    _fill(cache, k1, v1)
    (k_out, v_out), (k_out1, _) = _fill(cache, k2, v2)  # grows 4 -> 12 tokens
    assert cache.capacity == 12 and k_out.shape == (1, 2, 9, 8) and k_out.dtype == torch.float32
    want_k, want_v = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
    step_k = want_k.abs().amax(-1, keepdim=True) / 127
    assert ((k_out - want_k).abs() <= step_k / 2 + 1e-5).all()
    assert ((k_out1 - 2 * want_k).abs() <= step_k + 1e-5).all()  # layer 1 wrote 2 k
    assert ((v_out - want_v).abs() <= want_v.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()


def test_evict_moves_codes_and_scales_together():
    cache = KVCache(1, 1, 4, 32, dtype=torch.int8)
    k = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).expand(1, 1, 10, 4) * 10 + 1
    _fill(cache, k, -k)
    cache.remove_span(2, 5)
    assert cache.length == 7
    got, _ = cache.update(0, torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))
    torch.testing.assert_close(got[0, 0, :7, 0], torch.tensor([1.0, 11, 51, 61, 71, 81, 91]))


def test_transform_keys_requantizes():
    cache = KVCache(2, 1, 4, 16, dtype=torch.int8)
    k = torch.ones(1, 1, 5, 4)
    _fill(cache, k, k)
    cache.transform_keys(1, 1, 3, lambda seg: seg * 3)  # layer 1, slots 1 and 2
    got, _ = cache.update(1, torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))
    torch.testing.assert_close(got[0, 0, :5, 0], torch.tensor([2.0, 6, 6, 2, 2]))
    got0, _ = cache.update(0, torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))
    torch.testing.assert_close(got0[0, 0, :5, 0], torch.ones(5))  # layer 0 untouched


def test_a_sliding_layer_drops_codes_and_scales_together():
    """Layer 0 keeps a window of 3 tokens, layer 1 every token: after 12 one-token writes
    (chunks of 4, so layer 0 drops old tokens) each returns its positions' values."""
    cache = KVCache(2, 1, 4, 64, dtype=torch.int8, chunk_tokens=4, windows=[3, None])
    for t in range(12):
        x = torch.full((1, 1, 1, 4), 10.0 * t + 1)
        cache.reserve(1)
        k0, v0 = (u.clone() for u in cache.update(0, x, -x))
        k1, _ = cache.update(1, x, x)
        cache.advance(1)
    n0 = 12 - cache.start[0]
    assert cache.start[0] > 0 and k0.shape[2] == n0 >= 3 and k1.shape[2] == 12
    torch.testing.assert_close(k0[0, 0, :, 0], torch.tensor([10.0 * p + 1 for p in range(cache.start[0], 12)]))
    torch.testing.assert_close(v0[0, 0, :, 0], -k0[0, 0, :, 0])
    torch.testing.assert_close(k1[0, 0, :, 0], torch.tensor([10.0 * p + 1 for p in range(12)]))
    assert cache.allocated_bytes == sum(b.numel() * b.element_size() for b in (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale))


def test_the_static_write_refuses_an_int8_cache():
    cache = KVCache(1, 1, 4, 8, dtype=torch.int8)
    cache.reserve(1)
    with pytest.raises(ValueError, match="int8 cache is written by update"):
        cache.write_at(0, torch.tensor([0]), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


def test_a_tiny_model_decodes_nearly_the_same_with_an_int8_cache(tmp_path):
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32")
    ids = torch.randint(4, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = model.logits(ids)[0]
    cache = model.new_cache(64, dtype="int8")
    assert cache.dtype == torch.int8
    steps = [model.logits(ids[:8], cache)[0]] + [model.logits([t], cache)[0] for t in ids[8:]]
    got = torch.cat(steps)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("bad", ["int4", "uint8"])
def test_unknown_cache_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="unknown cache dtype"):
        parse_cache_dtype(bad)


def test_rerotated_keys_after_an_eviction_match_a_fresh_prefill(tmp_path):
    """Evicting tokens 2..4 and re-rotating the rest (the rolling policy) leaves layer 0's
    keys as a fresh prefill of the kept tokens computes them (they depend on the token
    and its position only): exactly for float32, within a quantization step for int8."""
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32")
    ids = torch.randint(4, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    fresh = model.new_cache(16)
    model.logits(ids[:2] + ids[5:], fresh)
    want = fresh.k[0][:, :, :9]
    for dtype in ("float32", "int8"):
        cache = model.new_cache(16, dtype=dtype)
        model.logits(ids, cache)
        cache.remove_span(2, 5)
        model.decoder.shift_key_positions(cache, 2, cache.length, -3)
        got, _ = cache.update(0, torch.zeros(1, cache.n_kv_heads, 0, cache.head_dim), torch.zeros(1, cache.n_kv_heads, 0, cache.head_dim))
        step = want.abs().amax(-1, keepdim=True) / 127
        bound = 1e-5 if dtype == "float32" else step + 1e-5  # twice half a step: stored, then requantized
        assert ((got[:, :, :9] - want).abs() <= bound).all(), dtype
