"""One decode step over several paged sequences: each row as if decoded alone."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.paged import PagePool, PagedSequence
from runtime.model.batch_step import decode_rows
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model

PROMPTS = [[5, 9, 33, 40, 41, 7, 8], [100, 101, 3 + 4, 12], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260]]


def _pool(model, dtype="float32"):
    c = model.config
    return PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=dtype, windows=c.windows, page_tokens=4)


def _alone(model, prompt, steps, dtype="float32"):
    """Greedy ids and each step's logits, one sequence, the decoder's own one-token path."""
    cache = model.new_cache(64, dtype=dtype)
    logits = model.logits(prompt, cache, last_only=True)[0, -1]
    ids, rows = [], [logits]
    for _ in range(steps):
        ids.append(int(torch.argmax(logits)))
        logits = model.logits([ids[-1]], cache)[0, -1]
        rows.append(logits)
    return ids, torch.stack(rows)


def _batched(model, prompts, steps, dtype="float32", join_at=None):
    """Greedy ids and logits of every prompt decoded together (prompt 2 joins after ``join_at`` steps)."""
    pool = _pool(model, dtype)
    seqs, last = [], []
    ids: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]

    def join(i):
        s = PagedSequence(pool, 64)
        last.append(model.logits(prompts[i], s, last_only=True)[0, -1])
        s.record(prompts[i])
        rows[i].append(last[-1])
        seqs.append(s)

    for i in range(len(prompts) if join_at is None else len(prompts) - 1):
        join(i)
    for step in range(steps + (join_at or 0)):
        if join_at is not None and step == join_at:
            join(len(prompts) - 1)
        live = [i for i in range(len(seqs)) if len(ids[i]) < steps]
        for i in live:
            ids[i].append(int(torch.argmax(last[i])))
        out = decode_rows(model.decoder, [ids[i][-1] for i in live], [seqs[i] for i in live])
        for b, i in enumerate(live):
            last[i] = out[b]
            rows[i].append(out[b])
            seqs[i].record([ids[i][-1]])
    for s in seqs:
        s.release()
    assert pool.stats()["pages_used"] == 0
    return ids, [torch.stack(r) for r in rows]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {f: load_model(make_tiny_model(root, f), device="cpu", dtype="float32", threads=1)
            for f in ("llama", "gemma3", "gpt2")}


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_batched_greedy_replies_equal_each_alone(tiny, family):
    """Three sequences of different lengths (Gemma 3: sliding layers and multi-query attention,
    GPT-2: learned positions); the third joins two steps late."""
    model = tiny[family]
    ids, rows = _batched(model, PROMPTS, 10, join_at=2)
    for i, prompt in enumerate(PROMPTS):
        want_ids, want_rows = _alone(model, prompt, 10)
        assert ids[i] == want_ids
        torch.testing.assert_close(rows[i], want_rows, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_batched_rows_with_a_narrow_cache(tiny, dtype):
    model = tiny["llama"]
    ids, rows = _batched(model, PROMPTS[:2], 6, dtype=dtype)
    for i, prompt in enumerate(PROMPTS[:2]):
        want_ids, want_rows = _alone(model, prompt, 6, dtype=dtype)
        assert ids[i] == want_ids
        torch.testing.assert_close(rows[i], want_rows, rtol=1e-5, atol=1e-5)


def test_reproducible_mode_batched_rows_are_bit_equal_to_alone(tmp_path):
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32", reproducible=True)
    prompts = [torch.randint(4, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 3, 17)]
    ids, rows = _batched(model, prompts, 8, join_at=3)
    for i, prompt in enumerate(prompts):
        want_ids, want_rows = _alone(model, prompt, 8)
        assert ids[i] == want_ids
        assert torch.equal(rows[i], want_rows)


def test_decode_rows_refuses_what_it_cannot_run(tiny):
    model = tiny["llama"]
    s = PagedSequence(_pool(model), 64)
    with pytest.raises(ValueError, match="one token per distinct sequence"):
        decode_rows(model.decoder, [1, 2], [s, s])
    with pytest.raises(ValueError, match="one token per distinct sequence"):
        decode_rows(model.decoder, [], [])
