"""``KVCache.shrink_to_fit``: an idle cache's buffers cut to the smallest chunk multiple
that holds its tokens (a pooled server session would otherwise keep a long reply's buffers),
with nothing dropped: the same bytes in use, the same values, the same decoding after."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.kv_cache import KVCache
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model


def _write(cache: KVCache, n: int, start_value: float = 0.0) -> None:
    cache.reserve(n)
    vals = torch.arange(n, dtype=torch.float32) + start_value
    k = vals.view(1, 1, n, 1).expand(1, cache.n_kv_heads, n, cache.head_dim)
    for layer in range(cache.n_layers):
        cache.update(layer, k, -k)
    cache.advance(n)


def _held(cache: KVCache, layer: int) -> torch.Tensor:
    n = cache.length - cache.start[layer]
    return cache.k[layer][:, :, :n].float().clone()


def test_a_cropped_cache_shrinks_to_one_chunk_and_keeps_its_tokens():
    cache = KVCache(2, 2, 4, 100, chunk_tokens=8)
    _write(cache, 20)
    assert cache.capacity == 24
    cache.crop(5)
    before = [_held(cache, i) for i in range(2)]
    used = cache.used_bytes
    assert cache.shrink_to_fit() == 16 * cache.bytes_per_token
    assert (cache.length, cache.capacity) == (5, 8)
    assert cache.allocated_bytes == 8 * cache.bytes_per_token and cache.used_bytes == used
    assert all(torch.equal(_held(cache, i), before[i]) for i in range(2))
    assert cache.v[1][0, 0, :5, 0].tolist() == [-float(i) for i in range(5)]
    _write(cache, 10, start_value=5)  # and it grows again by whole chunks
    assert (cache.length, cache.capacity) == (15, 16)
    assert cache.k[0][0, 1, :15, 3].tolist() == [float(i) for i in range(15)]


def test_a_cache_that_fits_is_left_alone_and_an_empty_one_is_released():
    cache = KVCache(1, 1, 2, 100, chunk_tokens=8)
    _write(cache, 12)
    buffers = [cache.k[0], cache.v[0]]
    assert cache.shrink_to_fit() == 0
    assert cache.k[0] is buffers[0] and cache.v[0] is buffers[1]  # no copy
    cache.reset()
    assert cache.shrink_to_fit() == 16 * cache.bytes_per_token
    assert cache.allocated_bytes == 0 and cache.capacity == 0


def test_an_int8_cache_shrinks_its_scales_with_its_codes():
    cache = KVCache(2, 2, 8, 64, dtype=torch.int8, chunk_tokens=4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    cache.reserve(10)
    for layer in range(2):
        want = cache.update(layer, k, v)
    cache.advance(10)
    cache.crop(3)
    assert cache.shrink_to_fit() == 8 * cache.bytes_per_token  # 12 -> 4 tokens, scales counted
    assert [t.shape[2] for t in (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale)] == [4] * 8
    cache.reserve(0)
    got = cache.update(1, k[:, :, 3:4], v[:, :, 3:4])  # slot 3: the history read back
    assert torch.equal(got[0][:, :, :3], want[0][:, :, :3]) and torch.equal(got[1][:, :, :3], want[1][:, :, :3])


def test_a_sliding_layer_keeps_what_it_holds_and_can_still_crop():
    cache = KVCache(2, 1, 2, 100, chunk_tokens=8, windows=(None, 4))
    _write(cache, 20)  # one prefill: the sliding layer's buffer took all 20 (24 slots)
    cache.crop(14)
    points = [cache.crop_point(n) for n in range(15)]
    before = [_held(cache, i) for i in range(2)]
    assert cache.shrink_to_fit() == 2 * 8 * cache.layer_bytes_per_token(0)
    assert [cache.k[i].shape[2] for i in range(2)] == [16, 16]
    assert [cache.crop_point(n) for n in range(15)] == points
    assert all(torch.equal(_held(cache, i), before[i]) for i in range(2))


@pytest.mark.parametrize("family", ["llama", "qwen2-window"])  # qwen2-window: a full and a sliding layer
def test_decoding_after_a_shrink_is_the_same(tmp_path, family):
    """Two caches take the same 270-token prompt (512 slots), are cropped to 250 (a pooled
    session taken over by a shorter conversation), one shrinks to 256 slots; both then
    decode 24 greedy tokens."""
    model = load_model(make_tiny_model(tmp_path, family, max_positions=1024), device="cpu", dtype="float32")
    ids = torch.randint(4, VOCAB_SIZE, (270,), generator=torch.Generator().manual_seed(5)).tolist()
    caches = [model.new_cache(1024), model.new_cache(1024)]
    for cache in caches:
        model.logits(ids, cache, last_only=True)
        cache.crop(250)
    kept, shrunk = caches
    assert shrunk.shrink_to_fit() == 256 * shrunk.bytes_per_token
    assert (kept.allocated_bytes, shrunk.allocated_bytes) == (512 * kept.bytes_per_token, 256 * kept.bytes_per_token)
    assert kept.used_bytes == shrunk.used_bytes

    def greedy(cache: KVCache) -> tuple[list[int], list[torch.Tensor]]:
        token, tokens, rows = ids[250], [], []
        for _ in range(24):
            rows.append(model.logits([token], cache)[0, -1])
            token = int(rows[-1].argmax())
            tokens.append(token)
        return tokens, rows

    (want, want_rows), (got, got_rows) = greedy(kept), greedy(shrunk)
    assert got == want
    for a, b in zip(got_rows, want_rows):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
