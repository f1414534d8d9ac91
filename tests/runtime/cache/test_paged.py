"""The paged KV cache: pages from one pool, equal to the contiguous cache bit for bit in float32,
every dtype, sliding windows releasing pages, shared prefixes, copy-on-write, freeing, the limit."""
from __future__ import annotations

import pytest
import torch

from runtime.cache.paged import PagePool, PagedSequence
from runtime.errors import CacheLimitError


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("paged")
    return {f: load_model(make_tiny_model(root, f), device="cpu", dtype="float32", threads=1)
            for f in ("llama", "mistral-window")}


def _pool(model, dtype="float32", **kw) -> PagePool:
    c = model.config
    return PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=dtype, windows=c.windows, page_tokens=4, **kw)


def _run(model, cache, chunks):
    """Feed each chunk of ids; returns the logits of every chunk (float32)."""
    out = []
    for ids in chunks:
        out.append(model.logits(ids, cache))
        if isinstance(cache, PagedSequence):
            cache.record(ids)
    return out


IDS = [(7 * i + 3) % 300 + 4 for i in range(30)]
CHUNKS = [IDS[:9], IDS[9:10], IDS[10:11], IDS[11:23], IDS[23:24], IDS[24:25], IDS[25:30]]


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_logits_equal_the_contiguous_cache_bit_for_bit(models, family, dtype):
    model = models[family]
    contiguous = model.new_cache(64, dtype=dtype)
    seq = PagedSequence(_pool(model, dtype), 64)
    for a, b in zip(_run(model, contiguous, CHUNKS), _run(model, seq, CHUNKS)):
        assert torch.equal(a, b)
    assert seq.length == contiguous.length == 30
    # Stored values: layer 0's keys as the decoder reads them, position by position.
    k, _ = seq.pool.read(0, seq._held(0), 0, seq.length - seq.start[0], torch.float32)
    ck = contiguous.read_keys(0)
    n = min(k.shape[2], ck.shape[2])  # a sliding layer: each holds at least its window
    assert n >= (8 if family != "llama" else 30)
    assert torch.equal(k[:, :, -n:].float(), ck[:, :, -n:])


def test_sliding_window_layers_release_pages_behind_the_window(models):
    model = models["mistral-window"]  # window 8 tokens in every layer
    pool = _pool(model)
    seq = PagedSequence(pool, 64)
    _run(model, seq, [IDS[:9]] + [[t] for t in IDS[9:30]])
    # The next query at 30 sees 23..30: pages 5, 6, 7 (4 tokens each) of every layer, no more.
    assert seq.first_page == [5]
    assert seq.start == [20, 20]
    assert pool.stats()["pages_used"] == 3
    assert seq.stats()["pages"] == 3


def test_shared_prompt_pages_are_stored_once_and_give_the_same_logits(models):
    model = models["llama"]
    pool = _pool(model)
    system = IDS[:12]  # three full pages
    first = PagedSequence(pool, 64)
    _run(model, first, [system + [5, 6]])
    used = pool.stats()["pages_used"]
    assert used == 4
    others = []
    for tail in ([8, 9], [10, 11, 12]):
        seq = PagedSequence(pool, 64)
        assert seq.adopt(system + tail) == 12
        logits = _run(model, seq, [tail])[-1]
        alone = _run(model, model.new_cache(64), [system, tail])[-1]  # the same chunks, contiguous
        assert torch.equal(logits, alone)
        others.append(seq)
    s = pool.stats()
    assert s["pages_shared"] == 3 and s["pages_used"] == used + 2  # each tail: one page of its own
    assert others[0].stats()["shared_pages"] == 3
    # Another salt (another API key) shares nothing.
    assert PagedSequence(pool, 64, salt="other").adopt(system + [1]) == 0


def test_fork_copies_the_shared_page_at_the_first_differing_token(models):
    model = models["llama"]
    pool = _pool(model)
    a = PagedSequence(pool, 64)
    _run(model, a, [IDS[:6]])  # pages 0 (full) and 1 (2 of 4 slots)
    before = pool.read(0, a._held(0), 0, 6, torch.float32)[0].clone()
    b = PagedSequence(pool, 64)
    assert b.fork(a, 6) == 6
    assert b.tables == a.tables and pool.refs(0, a.tables[0][1]) == 2
    logits_b = _run(model, b, [[99, 98]])[-1]
    assert b.tables[0][0] == a.tables[0][0] and b.tables[0][1] != a.tables[0][1]  # copied on write
    assert pool.refs(0, a.tables[0][1]) == 1
    assert torch.equal(pool.read(0, a._held(0), 0, 6, torch.float32)[0], before)  # a's untouched
    assert torch.equal(logits_b, _run(model, model.new_cache(64), [IDS[:6], [99, 98]])[-1])
    # a goes on as if b never was.
    assert torch.equal(_run(model, a, [[42]])[-1], _run(model, model.new_cache(64), [IDS[:6], [42]])[-1])


def test_freed_pages_are_reused_and_cached_prefixes_recycled_under_the_limit(models):
    model = models["llama"]
    probe = _pool(model)
    pool = _pool(model, limit_bytes=probe.groups[0].page_bytes * 5, chunk_pages=2)
    seq = PagedSequence(pool, 64)
    _run(model, seq, [IDS[:13]])  # 4 pages: 3 full (indexed), 1 partial
    assert pool.stats()["pages_used"] == 4
    seq.release()
    s = pool.stats()
    assert (s["pages_used"], s["pages_cached"], s["pages_free"]) == (0, 3, 1)
    other = PagedSequence(pool, 64)
    _run(model, other, [IDS[13:30]])  # 5 pages: the free one, one grown, then 3 cached ones recycled
    s = pool.stats()
    assert (s["pages_used"], s["pages_cached"], s["pages_total"]) == (5, 0, 5)
    assert pool.allocated_bytes <= pool.limit_bytes
    with pytest.raises(CacheLimitError, match="KV pool is full"):
        other.reserve(4)
    other.release()
    assert pool.stats()["pages_used"] == 0


def test_crop_gives_back_the_pages_after_the_point(models):
    model = models["llama"]
    pool = _pool(model)
    seq = PagedSequence(pool, 64)
    _run(model, seq, [IDS[:14]])
    seq.crop(5)
    assert (seq.length, len(seq.tables[0]), pool.stats()["pages_used"]) == (5, 2, 2)
    again = model.new_cache(64)
    _run(model, again, [IDS[:14]])
    again.crop(5)
    assert torch.equal(_run(model, seq, [[77]])[-1], _run(model, again, [[77]])[-1])
    with pytest.raises(CacheLimitError, match="context of 8"):
        PagedSequence(pool, 8).reserve(9)


def test_an_idle_pool_gives_its_arenas_back(models):
    model = models["llama"]
    pool = _pool(model)
    seq = PagedSequence(pool, 64)
    _run(model, seq, [IDS[:10]])
    assert pool.release_arenas() == 0  # a page is in use
    seq.release()
    assert pool.release_arenas() == 32 * pool.bytes_per_page and pool.allocated_bytes == 0
    assert pool.stats()["pages_cached"] == 0
    again = PagedSequence(pool, 64)
    assert again.adopt(IDS[:10]) == 0  # the cached prefix went with them
    _run(model, again, [IDS[:10]])
    assert pool.stats()["pages_used"] == 3


def test_a_contiguous_cache_counts_its_bytes_in_pages():
    from runtime.cache.kv_cache import KVCache

    cache = KVCache(30, 3, 64, 8192, chunk_tokens=256)  # the default model's shape, float32
    cache.reserve(40)
    for layer in range(30):
        cache.update(layer, torch.zeros(1, 3, 40, 64), torch.zeros(1, 3, 40, 64))
    cache.advance(40)
    pages = cache.stats()["pages"]
    # 16 x 46,080 = 737,280 bytes a page; 40 tokens fill 3 pages; 256 allocated = 16 pages.
    assert pages == {"page_tokens": 16, "bytes_per_page": 737_280, "used": 3, "shared": 0, "free": 13}
    pool = PagePool(30, 3, 64)
    assert pool.bytes_per_page == pages["bytes_per_page"]
