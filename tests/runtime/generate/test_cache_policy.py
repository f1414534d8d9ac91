"""A chat session under a cache policy (tiny seeded llama, greedy): the cache stays within its
budget, the stats say what was evicted, and the prefix reuse across turns is right.

"Right" is checked against a replay: the same token stream fed to a fresh cache with the
same evictor, in the same pieces (prompt chunks, then one token per decode step), must give
the tokens the session gave; and where a turn cannot continue from the cache because a
later eviction took tokens before its crop point, the session goes back to the last point
the cache still holds whole, never further.
"""
from __future__ import annotations

import pytest
import torch

from runtime import ChatSession, Evictor, GenerationSettings, load_model
from runtime.cache.policies.evictor import DEFAULT_STEP
from tests.runtime.session_helpers import run_turn
from tests.runtime.tiny_models import WORDS, make_tiny_model

BUDGET, CHUNK = 48, 32
FIRST = " ".join(WORDS[:50]) + " cat dog hat " + " ".join(WORDS[10:50])  # ~100 tokens with the template
SECOND = " ".join(WORDS[20:50])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("policy"), "llama", max_positions=1024),
                      device="cpu", dtype="float32")


def _no_stop(model):
    """A logits processor that keeps the random model from ending its replies and lets it
    write only the tokenizer's merged (ASCII) pieces, so each reply's ids are kept as written
    (a byte token alone may decode to U+FFFD, and then the reply is retokenized)."""
    banned = torch.arange(260)  # special tokens and single bytes (tests.runtime.tiny_models)

    def process(generated, row):
        return row.index_fill(0, banned, float("-inf"))

    return process


def _session(model, policy="h2o", budget=BUDGET, **kw) -> ChatSession:
    st = GenerationSettings(max_new_tokens=kw.pop("max_new_tokens", 40), context_limit=kw.pop("context", 1024),
                            cache_policy=policy, cache_budget=budget, prefill_chunk=CHUNK, overflow="stop",
                            logits_processors=(_no_stop(model),), **kw)
    return ChatSession(model, settings=st)


class Feeds:
    """Records what the session feeds its model (each call's ids), to replay it."""

    def __init__(self, session):
        self.calls: list[list[int]] = []
        feed = session.kv.feed

        def recording(ids, *, last_only):
            self.calls.append(list(ids))
            return feed(ids, last_only=last_only)

        session.kv.feed = recording


def _replay(model, policy, calls) -> tuple[list[int], object]:
    """Greedy tokens after each call, fed to a fresh cache with the same evictor."""
    cache = model.new_cache(1024)
    ev = Evictor.within(policy, BUDGET, step=DEFAULT_STEP).attach(cache)
    out = []
    for ids in calls:
        row = _no_stop(model)(None, model.logits(ids, cache, last_only=True)[0, -1])
        ev.evict(cache)
        out.append(int(row.argmax()))
    return out, cache


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova", "key-norm", "sinks-window"])
def test_turns_continue_from_the_evicted_cache_exactly(model, policy):
    s = _session(model, policy)
    rec = Feeds(s)
    t1 = run_turn(s, s.send(FIRST))
    assert t1.stats.prompt_tokens > BUDGET + CHUNK and t1.finish.reason == "length"
    assert max(t.stats.kv_cache["tokens"] for t in [t1]) <= BUDGET
    assert t1.stats.evicted_tokens == len(s.kv.stream) - s.cache.held_tokens > 0
    kv = t1.stats.kv_cache
    assert (kv["positions"], kv["evicted_tokens"]) == (s.cache.length, t1.stats.evicted_tokens)
    assert kv["used_bytes"] == kv["tokens"] * kv["bytes_per_token"] < kv["full_bytes"]
    n1 = len(s.kv.stream)
    t2 = run_turn(s, s.send(SECOND))
    # Turn 2 continues from the cache: every token turn 1 read is reused, none re-read.
    assert t2.stats.reused_tokens == n1 and t2.stats.prefilled_tokens == t2.stats.prompt_tokens - n1
    assert t2.stats.evicted_tokens > t1.stats.evicted_tokens
    # The replay of the same pieces gives the same tokens and the same cache.
    replay, cache = _replay(model, policy, rec.calls)
    decoded = [i for i in range(1, len(rec.calls)) if len(rec.calls[i]) == 1]
    assert len(decoded) >= 70  # both replies' steps
    assert all(replay[i - 1] == rec.calls[i][0] for i in decoded)
    assert cache.held_tokens == s.cache.held_tokens and torch.equal(cache.positions(1), s.cache.positions(1))


@pytest.mark.parametrize("policy", ["tova", "sinks-window"])
def test_regenerate_goes_back_to_what_the_cache_holds_whole(model, policy):
    """The reply evicted prompt tokens: regenerating cannot reuse the prompt's cache (those
    tokens are gone), so the session crops to the last point before the eviction that took
    them and reads the rest again, giving the same greedy reply."""
    s = _session(model, policy, max_new_tokens=60)
    first = run_turn(s, s.send(FIRST))
    prompt = first.stats.prompt_tokens
    assert any(length > prompt and lowest < prompt - 1 for length, lowest, _ in s.cache.evictions)
    again = run_turn(s, s.regenerate())
    point = again.stats.reused_tokens
    assert point < prompt - 1 and again.stats.prefilled_tokens == prompt - point
    assert again.finish.token_ids == first.finish.token_ids


def test_the_conversation_runs_past_the_budget_to_the_context_limit(model):
    s = _session(model, "sinks-window", budget=40, context=200, max_new_tokens=300)
    t = run_turn(s, s.send(FIRST))
    assert t.finish.reason == "context" and s.cache.length == 200
    assert max(t.cache_lengths) == 200 and s.cache.held_tokens <= 40
    assert t.stats.context_limit == 200 and t.stats.evicted_tokens == 200 - s.cache.held_tokens


def test_budgets_in_bytes_and_settings_errors(model):
    per_token = model.new_cache(8).bytes_per_token
    s = _session(model, "tova", budget=None, cache_budget_bytes=30 * per_token)
    assert s.evictor is not None and s.evictor.ceiling == 30
    s = _session(model, "tova", budget=100, cache_budget_bytes=30 * per_token)
    assert s.evictor.ceiling == 30  # the smaller of the two
    assert _session(model, "tova", budget=5000).evictor is None  # never full: no policy at work
    with pytest.raises(ValueError, match="needs a budget"):
        GenerationSettings(cache_policy="h2o")
    with pytest.raises(ValueError, match="rolling"):
        GenerationSettings(cache_policy="h2o", cache_budget=64, overflow="rolling")
    with pytest.raises(ValueError, match="unknown cache policy 'lru'"):
        GenerationSettings(cache_policy="lru")
    # A budget just under the memory limit reads a prompt in the chunks that fit beside it.
    s = _session(model, "h2o", budget=60, cache_limit_bytes=64 * per_token)
    assert s.evictor.ceiling == 60 and s.kv.chunk == 4
    t = run_turn(s, s.send(FIRST))
    assert t.finish.reason == "length" and s.cache.held_tokens <= 60


def _held_after_each_event(session, events) -> list[int]:
    held = []
    run_turn(session, events, lambda ev, *_: held.append(session.cache.held_tokens))
    return held


@pytest.mark.parametrize("budget", [256, 40, 4])
def test_the_budget_is_a_ceiling_the_cache_never_passes(model, budget):
    """A 256-token budget kept 264 tokens: the evictor ran only at budget + 16, so between
    evictions (and at a reply's end) the cache held up to 15 tokens past what the user set,
    and a MiB budget was passed by as much. Now after every forward it holds at most the budget."""
    s = _session(model, "h2o", budget=budget, max_new_tokens=60)
    long = " ".join(WORDS * 4)   # ~400 tokens: read in chunks, past every budget here
    held = _held_after_each_event(s, s.send(long))
    assert max(held) <= budget and held[-1] > budget - DEFAULT_STEP
    assert s.cache.length > budget + DEFAULT_STEP   # evictions did happen
    held = _held_after_each_event(s, s.send(SECOND))
    assert max(held) <= budget


def test_a_budget_in_bytes_is_never_passed(model):
    per_token = model.new_cache(8).bytes_per_token
    s = _session(model, "snapkv", budget=None, cache_budget_bytes=50 * per_token, max_new_tokens=50)
    run_turn(s, s.send(" ".join(WORDS * 3)))
    assert s.cache.used_bytes <= 50 * per_token and s.cache.held_tokens <= 50


def test_allocated_shrinks_to_what_the_policy_holds(model):
    """A long prompt read under a 40-token budget grows the buffers to two 256-token chunks
    while a chunk is read; after the eviction "allocated" comes back to the one chunk that
    holds the budget and the next step."""
    st = GenerationSettings(max_new_tokens=20, context_limit=1024, cache_policy="h2o", cache_budget=40,
                            overflow="stop", logits_processors=(_no_stop(model),))   # the default 256-token chunks
    s = ChatSession(model, settings=st)
    t = run_turn(s, s.send(" ".join(WORDS * 6)))
    assert t.stats.prompt_tokens > 2 * 256 and s.cache.held_tokens <= 40
    assert s.cache.allocated_bytes == 256 * s.cache.bytes_per_token
    assert t.stats.kv_cache["allocated_bytes"] == s.cache.allocated_bytes
