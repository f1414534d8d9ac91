"""The batched decode step as one ggml graph (runtime/model/ggml_batch.py) on a tiny GGUF: each
row's logits equal the same sequence decoded alone through the one-graph token, bit for bit,
with its pages in any order in the arenas, rows joining and leaving, the arenas growing; what
it does not take is said."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.paged import PagePool, PagedSequence
from runtime.kernels import ggml_ops
from runtime.model import ggml_batch
from runtime.model.batch_step import decode_rows
from runtime.model.ggml_batch import BatchGraphs, unsupported
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")

PROMPTS = [[5, 9, 33, 40, 41, 7, 8], [100, 101, 7, 12], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 61, 62]]
STEPS = 9


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggml-batch")
    path = make_tiny_gguf(folder, tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE, embed_type="Q8_0")
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    mp.setenv("ATTNCHAT_KERNELS", "default")
    try:
        m = load_model(path, device="cpu", threads=1)
        assert m.decode_mode == "ggml"
        yield m
    finally:
        mp.undo()


def _pool(model, dtype="float32"):
    c = model.config
    # two pages a chunk: the arenas grow (and move) while the rows decode
    return PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=dtype, windows=c.windows, page_tokens=4, chunk_pages=2)


def _alone(model, prompt, steps, dtype="float32"):
    """Greedy ids and each step's logits of one sequence through the one-graph token."""
    cache = model.new_cache(64, dtype=dtype)
    with torch.inference_mode():
        logits = model.logits(prompt, cache, last_only=True)[0, -1]
        ids, rows = [], [logits]
        for _ in range(steps):
            ids.append(int(torch.argmax(logits)))
            logits = model.decode_next(ids[-1], cache)[0, -1].clone()
            rows.append(logits)
    assert model._step._ggml.tokens, "the one-graph token did not run"
    return ids, torch.stack(rows)


def _batched(model, step, prompts, steps, pool):
    """Greedy ids and logits of every prompt decoded together by ``step(tokens, seqs)``: the last
    prompt joins two steps late, the first leaves three steps early."""
    seqs, last = [None] * len(prompts), [None] * len(prompts)
    ids: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    want = [steps - 3] + [steps] * (len(prompts) - 1)

    def join(i):
        s = seqs[i] = PagedSequence(pool, 64)
        with torch.inference_mode():
            last[i] = model.logits(prompts[i], s, last_only=True)[0, -1]
        s.record(prompts[i])
        rows[i].append(last[i])

    for i in range(len(prompts) - 1):
        join(i)
    for t in range(steps + 2):
        if t == 2:
            join(len(prompts) - 1)
        live = [i for i in range(len(prompts)) if seqs[i] is not None and len(ids[i]) < want[i]]
        if not live:
            break
        for i in live:
            ids[i].append(int(torch.argmax(last[i])))
        out = step([ids[i][-1] for i in live], [seqs[i] for i in live])
        for b, i in enumerate(live):
            last[i] = out[b].clone()
            rows[i].append(last[i])
            seqs[i].record([ids[i][-1]])
    for s in seqs:
        s.release()
    assert pool.stats()["pages_used"] == 0
    return ids, [torch.stack(r) for r in rows], want


def _scrambled(pool):
    """A pool whose free pages come back in reverse order (a sequence held and released them):
    the rows' pages lie in the arenas out of position order."""
    s = PagedSequence(pool, 64)
    s.reserve(24)
    s.advance(24)
    s.release()
    return pool


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_in_one_graph_equal_each_sequence_alone(model, monkeypatch, dtype):
    """Bit for bit in every float pool dtype (a 16-bit one read at 16 bits, as the one-sequence
    graph reads a 16-bit cache), with the LM head run a row at a time: the head kernel's exact top logits go
    through torch's ``bmm``, whose sums differ by ~1e-8 between a batch and one row. The rows'
    gather buffers, shared by the graphs of each batch size, grow (and move) every 4 keys."""
    monkeypatch.setattr(ggml_batch, "GROW_TOKENS", 4)
    head = model.decoder._logits
    monkeypatch.setattr(model.decoder, "_logits", lambda x: torch.cat([head(x[b : b + 1]) for b in range(len(x))]))
    pool = _scrambled(_pool(model, dtype))
    graphs = BatchGraphs(model.decoder, pool)
    ids, rows, want = _batched(model, graphs.decode, PROMPTS, STEPS, pool)
    assert sorted(graphs.graphs) == [1, 2, 3]   # a graph per batch size seen
    assert len(graphs.gathers) == 3 and graphs.gathers[0].version > 3
    for i, prompt in enumerate(PROMPTS):
        want_ids, want_rows = _alone(model, prompt, want[i], dtype)
        assert ids[i] == want_ids
        assert torch.equal(rows[i], want_rows), (rows[i] - want_rows).abs().max()


def test_one_graph_agrees_with_the_eager_rows(model):
    """Against decode_rows (torch's norms, RoPE and attention over the same float32 pages): to
    rounding, the same greedy ids."""
    pool = _pool(model)
    ids, rows, _ = _batched(model, BatchGraphs(model.decoder, pool).decode, PROMPTS, STEPS, pool)
    ref_ids, ref_rows, _ = _batched(model, lambda t, s: decode_rows(model.decoder, t, s), PROMPTS, STEPS, pool)
    assert ids == ref_ids
    for a, b in zip(rows, ref_rows):
        assert (a - b).abs().max().item() <= 0.02 * b.abs().mean().item() + 1e-4


def test_what_the_graph_does_not_take(model):
    c = model.config
    int8 = PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype="int8", page_tokens=4)
    assert "int8" in unsupported(model.decoder, int8)
    with pytest.raises(ValueError, match="does not take this model: a torch.int8 pool"):
        BatchGraphs(model.decoder, int8)
    meta = PagePool(c.n_layers, c.n_kv_heads, c.head_dim, page_tokens=4, device="meta")   # no arena until a page
    assert unsupported(model.decoder, meta) == "a torch.float32 pool on meta"
    graphs = BatchGraphs(model.decoder, _pool(model))
    s = PagedSequence(graphs.pool, 64)
    with pytest.raises(ValueError, match="one token per distinct sequence"):
        graphs.decode([1, 2], [s, s])
    assert s.length == 0
