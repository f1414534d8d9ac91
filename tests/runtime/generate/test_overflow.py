"""The context-overflow policies on the real default model, at a 128-token context.

Each test is a short multi-turn conversation whose replies run into the context limit;
``run_turn`` records the cache length at every event so "never past 128" is checked
throughout a reply, not only at its end. Expected prompt and drop sizes are computed
here from the rendered conversation.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from runtime.generate.chat_format import Message, encode_messages
from runtime.generate.events import GenerationSettings
from runtime.generate.session import ChatSession
from tests.runtime.session_helpers import (
    assert_cache_starts_with,
    conversation_ids,
    run_turn,
)

pytestmark = pytest.mark.slow

CONTEXT = 128
SYS = "Be brief."
#: A long first message (~80 tokens with the template) so replies reach the limit soon.
SETTING = (
    "Here is the setting of my story: a small fishing village by a cold northern sea, where a "
    "young girl called Mira lives with her grandmother, a retired sailor who tells tales of sea "
    "monsters. One winter night a storm wrecks a strange ship on the rocks. Write the story of "
    "what Mira finds on the ship."
)
KNIGHT = "Tell me a long story about a brave knight and a dragon who lived in the mountains near a small village."


def _session(model, policy: str, max_new_tokens: int, **kw) -> ChatSession:
    settings = GenerationSettings(max_new_tokens=max_new_tokens, context_limit=CONTEXT, overflow=policy, **kw)
    return ChatSession(model, system_prompt=SYS, settings=settings)


def _system_ids(model) -> list[int]:
    ids = encode_messages(model.tokenizer, [Message("system", SYS)], add_generation_prompt=False)
    assert conversation_ids(model, SYS, [Message("user", "x")])[: len(ids)] == ids
    return ids


def _within_context(turn) -> None:
    assert max(turn.cache_lengths) <= CONTEXT
    assert turn.stats.kv_cache["tokens"] <= CONTEXT and turn.stats.context_limit == CONTEXT


def _readable(text: str) -> None:
    """Text a person could read: printable, several different words, none dominating."""
    words = text.split()
    assert len(text) >= 20 and len(words) >= 4, repr(text)
    printable = sum(c.isprintable() or c.isspace() for c in text)
    assert printable >= 0.95 * len(text), repr(text)
    assert len(set(words)) >= 4, repr(text)
    assert Counter(words).most_common(1)[0][1] <= len(words) // 2, repr(text)


def test_stop_policy_ends_the_reply_at_the_limit(default_model):
    m = default_model
    s = _session(m, "stop", max_new_tokens=100)
    t1 = run_turn(s, s.send("What is 2+2?"))
    assert t1.finish.reason == "stop"
    t2 = run_turn(s, s.send(SETTING))
    _within_context(t2)
    assert t2.stats.prompt_tokens == len(conversation_ids(m, SYS, s.messages[:-1]))
    assert t2.finish.reason == "context" and t2.text
    # The cache filled to the last slot; the token sampled from it ends the reply unfed.
    assert s.cache.length == CONTEXT
    assert t2.stats.completion_tokens == CONTEXT - t2.stats.prompt_tokens + 1
    assert s.messages[-1] == Message("assistant", t2.text)
    # The conversation no longer fits: the next turn stops at once and changes nothing.
    t3 = run_turn(s, s.send("Thanks!"))
    assert t3.finish.reason == "context"
    assert (t3.text, t3.stats.completion_tokens, t3.stats.prefilled_tokens) == ("", 0, 0)
    assert t3.stats.prompt_tokens > CONTEXT and s.cache.length == CONTEXT
    _within_context(t3)


def test_truncate_middle_drops_old_turns_and_keeps_the_system_prompt(default_model):
    m = default_model
    s = _session(m, "truncate-middle", max_new_tokens=72)
    t1 = run_turn(s, s.send("Hi"))
    assert t1.finish.reason == "stop" and t1.stats.dropped_tokens == 0

    # Turn 2 fits at first (prompt <= 128 - 64 reserved for the reply); the reply then
    # outgrows the context and turn 1 is dropped while it runs.
    full2 = conversation_ids(m, SYS, s.messages + [Message("user", KNIGHT)])
    kept2 = conversation_ids(m, SYS, [Message("user", KNIGHT)])
    assert len(full2) <= CONTEXT - 64 and len(full2) + 72 > CONTEXT + 1
    t2 = run_turn(s, s.send(KNIGHT))
    _within_context(t2)
    assert t2.stats.prompt_tokens == len(full2)
    assert t2.finish.reason == "length" and t2.stats.completion_tokens == 72
    assert t2.stats.completion_tokens > CONTEXT - t2.stats.prompt_tokens  # went on past the limit
    assert t2.stats.dropped_tokens == len(full2) - len(kept2) > 0
    assert CONTEXT in t2.cache_lengths and t2.cache_lengths[-1] < CONTEXT
    # The cache now holds exactly: system prompt, turn 2's message, the reply (a length stop
    # feeds its last token).
    assert s.cache.length == len(kept2) + 72
    assert_cache_starts_with(m, s.cache, kept2)
    assert [msg.role for msg in s.messages] == ["user", "assistant"] * 2  # the conversation itself is whole

    # Turn 3: the conversation is over the limit before the reply; old turns drop up front.
    s.settings = replace(s.settings, max_new_tokens=6)
    q3 = "What was the name of the knight?"
    full3 = conversation_ids(m, SYS, s.messages + [Message("user", q3)])
    t3 = run_turn(s, s.send(q3))
    _within_context(t3)
    assert t3.finish.reason in ("stop", "length")
    assert t3.stats.dropped_tokens > 0
    assert t3.stats.prompt_tokens == len(full3) - t3.stats.dropped_tokens
    assert t3.stats.prefilled_tokens == t3.stats.prompt_tokens - t3.stats.reused_tokens
    assert_cache_starts_with(m, s.cache, _system_ids(m))


def test_rolling_keeps_the_sinks_and_goes_on_past_the_window(default_model):
    m, sink = default_model, 4
    s = _session(m, "rolling", max_new_tokens=64, sink_tokens=sink)
    prompt1 = conversation_ids(m, SYS, [Message("user", SETTING)])
    t1 = run_turn(s, s.send(SETTING))
    _within_context(t1)
    assert t1.stats.prompt_tokens == len(prompt1)
    assert t1.finish.reason == "length" and t1.stats.completion_tokens == 64
    assert t1.stats.completion_tokens > CONTEXT - t1.stats.prompt_tokens
    lengths = t1.cache_lengths
    evicted_at = next(i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1])
    assert max(lengths) == CONTEXT
    assert_cache_starts_with(m, s.cache, prompt1[:sink])
    # The text decoded after the eviction still reads as text.
    _readable(t1.text_from(evicted_at))

    # Turn 2: the conversation is past the window; the prefill evicts and the reply works.
    s.settings = replace(s.settings, max_new_tokens=6)
    q2 = "What did Mira find?"
    t2 = run_turn(s, s.send(q2))
    _within_context(t2)
    assert t2.finish.reason in ("stop", "length") and t2.text
    assert t2.stats.prompt_tokens == len(conversation_ids(m, SYS, s.messages[:-1])) > CONTEXT
    assert t2.stats.reused_tokens > 0
    assert t2.stats.prefilled_tokens == t2.stats.prompt_tokens - t2.stats.reused_tokens
    assert_cache_starts_with(m, s.cache, prompt1[:sink])


# ---- a tiny random model: long replies in milliseconds -------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def test_truncate_middle_counts_each_dropped_token_once(tiny_llama):
    """Turn 1 drops up front, turn 2 while the reply runs: dropped_tokens is the total
    dropped from the conversation, not the sum of the two drops."""
    m = tiny_llama
    s = ChatSession(m, settings=GenerationSettings(max_new_tokens=100, context_limit=CONTEXT, overflow="truncate-middle"))
    history = [Message("user", "who are you"), Message("assistant", "i am here"),
               Message("user", "what is it"), Message("assistant", "it is all")]
    s.messages = list(history)
    q = Message("user", "and then what")
    sizes = [len(encode_messages(m.tokenizer, history[i:] + [q])) for i in (0, 2, 4)]
    assert sizes[0] > CONTEXT - 64 >= sizes[1] and sizes[1] + 100 > CONTEXT >= sizes[2] + 100
    t = run_turn(s, s.send(q.content))
    assert t.stats.prompt_tokens == sizes[1]  # turn 1 dropped before the reply
    assert t.finish.reason == "length" and t.stats.completion_tokens == 100
    # Turn 2 dropped while it ran: the cache holds the last message and the reply.
    assert s.cache.length == sizes[2] + 100
    assert t.stats.dropped_tokens == sizes[0] - sizes[2]
    assert max(t.cache_lengths) <= CONTEXT
    # The four earlier messages were left out (two before the reply, two while it ran): said, so
    # the chat can fade them as it does for rolling.
    assert (t.stats.unseen_messages, t.stats.unseen_policy) == (4, "truncate-middle")
    assert (s.last_stats.unseen_messages, s.last_stats.unseen_policy) == (4, "truncate-middle")


# ---- the policy arithmetic (runtime.generate.context), no model -------------------------------------
def _words(messages) -> list[int]:
    """A stand-in encoder: 2 template tokens per message + one per word, + 3 for the system prompt."""
    return [0] * (3 + sum(2 + len(m.content.split()) for m in messages))


def test_fit_prompt_drops_whole_turns_only_under_truncate_middle():
    from runtime.generate.context import fit_prompt

    msgs = [Message("user", "a " * 10), Message("assistant", "b " * 10), Message("user", "c " * 5)]
    assert len(_words(msgs)) == 3 + 12 + 12 + 7 == 34
    for policy in ("stop", "rolling"):
        assert fit_prompt(_words, msgs, limit=30, reserve=10, policy=policy) == ([0] * 34, 0, 0)
    ids, dropped, first = fit_prompt(_words, msgs, limit=30, reserve=10, policy="truncate-middle")
    assert (len(ids), dropped, first) == (10, 24, 2)  # the first user message and its reply went together
    # Fits with room for the reply: nothing dropped.
    assert fit_prompt(_words, msgs, limit=44, reserve=10, policy="truncate-middle")[1] == 0
    assert fit_prompt(_words, msgs, limit=44, reserve=11, policy="truncate-middle")[1] == 24


@pytest.mark.parametrize("policy", ["stop", "truncate-middle", "rolling"])
def test_fit_prompt_rejects_a_message_that_never_fits(policy):
    from runtime.errors import ContextOverflowError
    from runtime.generate.context import fit_prompt

    msgs = [Message("user", "hi"), Message("user", "x " * 40)]
    with pytest.raises(ContextOverflowError) as err:
        fit_prompt(_words, msgs, limit=45, reserve=4, policy=policy)
    assert (err.value.prompt_tokens, err.value.context_limit) == (45, 45)


def test_rolling_eviction_keeps_the_sinks_and_evicts_a_quarter_window_at_least():
    from runtime.cache.policies.sinks_window import rolling_span as rolling_eviction

    assert rolling_eviction(100, 28, limit=128, sink_tokens=4) is None
    assert rolling_eviction(128, 1, limit=128, sink_tokens=4) == (4, 4 + 31)  # window 124 // 4
    assert rolling_eviction(120, 60, limit=128, sink_tokens=4) == (4, 4 + 52)
    assert rolling_eviction(6, 12, limit=16, sink_tokens=4) == (4, 6)  # no more than there is after the sinks
    assert rolling_eviction(16, 1, limit=16, sink_tokens=40) == (15, 16)  # sinks capped at limit - 1
    with pytest.raises(ValueError):
        rolling_eviction(128, 125, limit=128, sink_tokens=4)


def test_a_message_too_long_says_its_figures_with_thousands_separators():
    """The window said "needs 12329 tokens … holds 8192" beside a count line that says "12,329 … 8,192"."""
    from runtime.errors import ContextOverflowError
    from runtime.generate.context import fit_prompt

    with pytest.raises(ContextOverflowError) as err:
        fit_prompt(_words, [Message("user", "x " * 1200)], limit=1024, reserve=4, policy="stop")
    n = err.value.prompt_tokens
    assert n > 1024 and str(err.value).startswith(
        f"the message needs {n:,} tokens with the chat template but the context holds 1,024; shorten")
