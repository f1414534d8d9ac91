"""Continuous batching: replies stepped together equal each alone; each keeps its own sampling,
stops, processors and limits; cancel frees pages at once; shared prefixes; the memory limit."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.paged import PagePool
from runtime.generate.batch import Batcher, ReplyRequest
from runtime.generate.events import Finish, PrefillProgress, TextPiece
from runtime.generate.logits_processors import LogprobsRecorder
from runtime.generate.sampling import SamplingParams
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("batcher"), "llama"), device="cpu", dtype="float32",
                      threads=1)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(4, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def _pool(model, **kw) -> PagePool:
    c = model.config
    return PagePool(c.n_layers, c.n_kv_heads, c.head_dim, windows=c.windows, page_tokens=8, **kw)


def _serve(model, requests, *, max_batch=4, pool=None, chunk=5, cancel_after=None):
    """Run ``requests`` together; returns (events per request, the largest batch seen, the pool)."""
    pool = pool or _pool(model)
    events: dict[int, list] = {}
    batcher = Batcher(model, pool, max_batch=max_batch, prefill_chunk=chunk,
                      on_events=lambda r, evs: events.setdefault(id(r), []).extend(evs))
    replies = [batcher.add(req) for req in requests]
    widest = 0
    while batcher.busy:
        batcher.step()
        widest = max(widest, sum(1 for r in batcher.running if r.state == "decode"))
        if cancel_after is not None and batcher.steps == cancel_after[1]:
            used = pool.stats()["pages_used"]
            batcher.cancel(replies[cancel_after[0]])
            assert pool.stats()["pages_used"] < used  # freed at once
    return [events.get(id(r), []) for r in replies], widest, pool


def _finish(evs) -> Finish:
    done = [e for e in evs if isinstance(e, Finish)]
    assert len(done) == 1
    return done[0]


REQUESTS = [ReplyRequest(_prompt(n, n), max_new_tokens=20, context_limit=128) for n in (3, 17, 9, 30)]


def test_greedy_replies_together_equal_each_alone(tiny):
    together, widest, pool = _serve(tiny, REQUESTS)
    assert widest == 4
    for req, evs in zip(REQUESTS, together):
        alone, width, _ = _serve(tiny, [req], max_batch=1)
        assert width == 1
        got, want = _finish(evs), _finish(alone[0])
        assert got.token_ids == want.token_ids and len(got.token_ids) == 20 and got.reason == "length"
        assert got.text == want.text == "".join(e.text for e in evs if isinstance(e, TextPiece))
        # A long prompt is read over several steps (5 tokens each), with its progress.
        progress = [e for e in evs if isinstance(e, PrefillProgress)]
        assert progress[0] == PrefillProgress(0, len(req.prompt)) and progress[-1].done == len(req.prompt)
        assert len(progress) == 1 + -(-len(req.prompt) // 5)
    assert pool.stats()["pages_used"] == 0  # every reply gave its pages back


def test_short_prompts_are_read_in_one_step_each_in_its_own_chunks(tiny, monkeypatch):
    """Prompt tokens per step up to the chunk (12): prompts of 3 and 4 tokens are read in the
    first step with the 5 of the third; the fourth's first chunk (12 of 30) waits for the next
    step, alone, then its two later chunks. Each reply's chunks are cut as alone."""
    requests = [ReplyRequest(_prompt(n, 50 + n), max_new_tokens=4, context_limit=64) for n in (3, 4, 5, 30)]
    fed: list[tuple[int, int]] = []   # (step, tokens) of every chunk read
    batcher = Batcher(tiny, _pool(tiny), max_batch=4, prefill_chunk=12)
    logits = tiny.logits
    monkeypatch.setattr(tiny, "logits", lambda ids, seq, **kw: (fed.append((batcher.steps, len(ids))),
                                                              logits(ids, seq, **kw))[1])
    replies = [batcher.add(r) for r in requests]
    batcher.step()
    assert [r.state in ("decode", "done") for r in replies] == [True, True, True, False]   # (done: a stop token first)
    assert all(r.stats.ttft_s > 0 for r in replies[:3]) and replies[3].stats.ttft_s == 0
    batcher.run()
    monkeypatch.undo()
    assert fed == [(1, 3), (1, 4), (1, 5), (2, 12), (3, 12), (4, 6)]
    for req, reply in zip(requests, replies):
        alone, _, _ = _serve(tiny, [req], max_batch=1, chunk=12)
        assert reply.finish.token_ids == _finish(alone[0]).token_ids


def test_reproducible_mode_gives_the_same_bits_together_and_alone(tmp_path):
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32", reproducible=True)
    recorders = [LogprobsRecorder(top=0) for _ in range(6)]
    reqs = [ReplyRequest(_prompt(n, n + 1), max_new_tokens=8, context_limit=128, logits_processors=(rec,))
            for n, rec in zip((4, 11, 23), recorders[:3])]
    together, _, _ = _serve(model, reqs)
    for i, req in enumerate(reqs):
        alone, _, _ = _serve(model, [ReplyRequest(req.prompt, max_new_tokens=8, context_limit=128,
                                                  logits_processors=(recorders[3 + i],))], max_batch=1)
        a, b = _finish(together[i]), _finish(alone[0])
        assert a.token_ids == b.token_ids
        got = [t.logprob for t in recorders[i].finish(a.token_ids)]
        want = [t.logprob for t in recorders[3 + i].finish(b.token_ids)]
        assert got == want and len(got) == 8


def test_each_reply_keeps_its_own_sampling_stops_and_processors(tiny):
    greedy = REQUESTS[1]
    ban = ReplyRequest(greedy.prompt, max_new_tokens=12, context_limit=128,
                       logits_processors=(lambda gen, row: row.index_fill_(0, torch.tensor([_finish(
                           _serve(tiny, [greedy])[0][0]).token_ids[0]]), float("-inf")),))
    sampled = ReplyRequest(greedy.prompt, sampling=SamplingParams(temperature=1.0, seed=7), max_new_tokens=12,
                           context_limit=128)
    first_text = _finish(_serve(tiny, [greedy])[0][0]).text
    stop = ReplyRequest(greedy.prompt, max_new_tokens=12, context_limit=128, stop_strings=(first_text[3:5],))
    short = ReplyRequest(REQUESTS[0].prompt, max_new_tokens=2, context_limit=128)
    tight = ReplyRequest(REQUESTS[3].prompt, max_new_tokens=50, context_limit=36)
    results, _, _ = _serve(tiny, [greedy, ban, sampled, stop, short, tight], max_batch=6)
    g, b, s, st, sh, t = (_finish(evs) for evs in results)
    assert g.text == first_text
    assert b.token_ids[0] != g.token_ids[0]
    assert s.token_ids == _finish(_serve(tiny, [sampled])[0][0]).token_ids  # its own seeded generator
    assert s.token_ids != g.token_ids
    assert st.reason == "stop" and st.text == first_text[: first_text.index(first_text[3:5])]
    assert (sh.reason, len(sh.token_ids)) == ("length", 2)
    # The context holds prompt and reply but the last token, sampled and never fed (as a session does).
    assert t.reason == "context" and len(REQUESTS[3].prompt) + len(t.token_ids) == 36 + 1


def test_a_cancelled_reply_frees_its_pages_at_once_and_the_others_go_on(tiny):
    results, _, pool = _serve(tiny, REQUESTS[:3], cancel_after=(1, 6))
    assert _finish(results[1]).reason == "cancelled"
    for i in (0, 2):
        assert _finish(results[i]).token_ids == _finish(_serve(tiny, [REQUESTS[i]])[0][0]).token_ids
    assert pool.stats()["pages_used"] == 0


def test_a_shared_prompt_is_stored_once(tiny):
    system = _prompt(40, 99)  # five full pages of 8 tokens
    reqs = [ReplyRequest(system + _prompt(3, i), max_new_tokens=4, context_limit=128) for i in range(4)]
    seen = []
    pool = _pool(tiny)
    batcher = Batcher(tiny, pool, max_batch=4, prefill_chunk=64,
                      on_events=lambda r, evs: seen.extend((r, e) for e in evs if isinstance(e, Finish)))
    for req in reqs:
        batcher.add(req)
    batcher.step()  # admits all four; the first reads its prompt, the others fork it and read 3 tokens each
    assert [r.state for r in batcher.running] == ["decode"] * 4
    assert pool.stats()["pages_shared"] == 5  # the prompt's pages, once for all four
    batcher.run()
    finishes = [e for _, e in seen]
    assert [f.stats.reused_tokens for f in finishes] == [0, 40, 40, 40]
    assert finishes[-1].stats.kv_cache["pages"]["page_tokens"] == 8
    for req, f in zip(reqs, finishes):
        assert f.token_ids == _finish(_serve(tiny, [req], chunk=64)[0][0]).token_ids


def test_admission_keeps_every_running_reply_within_the_pool(tiny):
    probe = _pool(tiny)
    two = 2 * probe.bytes_for(REQUESTS[3].most_tokens)
    results, widest, pool = _serve(tiny, [REQUESTS[3]] * 4, pool=_pool(tiny, limit_bytes=two))
    assert widest == 2 and pool.allocated_bytes <= two
    assert len({_finish(evs).token_ids for evs in results}) == 1
    with pytest.raises(ValueError, match="lower max_tokens"):
        Batcher(tiny, _pool(tiny, limit_bytes=probe.groups[0].page_bytes)).add(REQUESTS[3])


def test_a_failing_processor_ends_its_reply_only(tiny):
    def broken(gen, row):
        if len(gen) == 3:
            raise RuntimeError("grammar bug")
        return row

    failed = []
    pool = _pool(tiny)
    done = []
    batcher = Batcher(tiny, pool, on_events=lambda r, evs: done.extend(e for e in evs if isinstance(e, Finish)),
                      on_failed=lambda r, e: failed.append(str(e)))
    batcher.add(ReplyRequest(REQUESTS[0].prompt, max_new_tokens=8, context_limit=128, logits_processors=(broken,)))
    batcher.add(REQUESTS[1])
    batcher.run()
    assert failed == ["grammar bug"] and len(done) == 1 and pool.stats()["pages_used"] == 0
