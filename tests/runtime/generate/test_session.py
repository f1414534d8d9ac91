"""ChatSession on the real default model: prefix reuse, edits, streaming, stop strings,
cancel, oversized messages and sampling.

The oracle for token ids is a plain greedy loop on a fresh cache
(``session_helpers.greedy_ids``); expected reuse counts are computed here from the
rendered conversation, never read back from the session. Replies are kept short
(the model decodes ~15 tokens/s on two CPU cores). Context policies: test_overflow.py.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from runtime.errors import ContextOverflowError
from runtime.generate.chat_format import Message
from runtime.generate.context import OVERFLOW_POLICIES
from runtime.generate.events import GenerationSettings, PrefillProgress, TextPiece
from runtime.generate.sampling import SamplingParams
from runtime.generate.session import ChatSession
from tests.runtime.session_helpers import (
    common_prefix,
    conversation_ids,
    greedy_ids,
    run_turn,
)

pytestmark = pytest.mark.slow

SYS = "You are a helpful assistant. Answer briefly."
U1 = "What is the capital of France?"
U2 = "And what is the capital of Italy?"
N = 10  # max new tokens of the two-turn conversation
LOGITS_ATOL = 1e-4


def _session(model, **settings) -> ChatSession:
    return ChatSession(model, system_prompt=SYS, settings=GenerationSettings(**settings))


# ---- prefix reuse, warm vs cold ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_turns(default_model):
    """U1 then U2 on one warm session, and U2 on a cold session given the same history."""
    m = default_model
    warm = _session(m, max_new_tokens=N)
    t1 = run_turn(warm, warm.send(U1))
    prompt1 = conversation_ids(m, SYS, [Message("user", U1)])
    ref1 = greedy_ids(m, prompt1, N)
    stream_after_1 = prompt1 + ref1   # a length stop feeds its last token too
    length_after_1 = warm.cache.length
    t2 = run_turn(warm, warm.send(U2))
    warm_logits = warm.last_logits.clone()

    cold = _session(m, max_new_tokens=N)
    cold.messages = [Message("user", U1), Message("assistant", t1.text, tuple(ref1))]   # as a store gives it back
    c2 = run_turn(cold, cold.send(U2))
    return dict(t1=t1, prompt1=prompt1, ref1=ref1, stream_after_1=stream_after_1,
                length_after_1=length_after_1, t2=t2, warm=warm, warm_logits=warm_logits,
                cold=cold, c2=c2)


def test_turn1_is_plain_greedy_and_fills_the_cache(two_turns, default_model):
    t1, ref1, prompt1 = two_turns["t1"], two_turns["ref1"], two_turns["prompt1"]
    assert t1.finish.reason in ("stop", "length")
    assert t1.stats.prompt_tokens == len(prompt1)
    assert (t1.stats.reused_tokens, t1.stats.prefilled_tokens) == (0, len(prompt1))
    assert t1.stats.completion_tokens == len(ref1) > 0
    assert t1.text == default_model.decode(ref1)
    # Every reply token went through the model (an end-of-turn token is never fed; a length
    # stop feeds its last token at the stop).
    assert two_turns["length_after_1"] == len(two_turns["stream_after_1"])
    # The reply names the CPU threads its decode steps ran on (runtime.kernels.threads).
    gov = default_model.decode_threads
    assert t1.stats.max_threads == gov.options[0] and t1.stats.decode_threads in gov.options


def test_turn2_prefills_only_the_new_message(two_turns, default_model):
    t1, t2 = two_turns["t1"], two_turns["t2"]
    # Turn 2's prompt is turn 1's prompt, the ids the model wrote, then the template's
    # end-of-turn and the new message: nothing of the reply is re-tokenized.
    new_part = default_model.encode(f"<|im_end|>\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n")
    prompt2 = two_turns["prompt1"] + two_turns["ref1"] + new_part
    assert two_turns["warm"].messages[1].token_ids == tuple(two_turns["ref1"])
    assert t2.stats.prompt_tokens == len(prompt2)
    assert t2.stats.retokenized_tokens == 0
    assert t2.stats.reused_tokens == len(two_turns["stream_after_1"])
    # Exactly the new message in its template, however turn 1 ended.
    assert t2.stats.prefilled_tokens == len(new_part)


def test_turn2_logits_equal_a_fresh_session(two_turns):
    cold = two_turns["cold"]
    assert two_turns["c2"].stats.reused_tokens == 0
    assert two_turns["c2"].stats.prompt_tokens == two_turns["t2"].stats.prompt_tokens
    torch.testing.assert_close(two_turns["warm_logits"], cold.last_logits, atol=LOGITS_ATOL, rtol=1e-5)


def test_warm_and_cold_caches_give_the_same_greedy_reply(two_turns, default_model):
    t2, c2 = two_turns["t2"], two_turns["c2"]
    assert t2.text == c2.text
    assert t2.stats.completion_tokens == c2.stats.completion_tokens
    assert t2.finish.reason == c2.finish.reason


# ---- edit and regenerate -------------------------------------------------------------------
def test_edit_and_regenerate_reuse_the_cache_up_to_the_first_difference(default_model, two_turns):
    m = default_model
    s = _session(m, max_new_tokens=6)
    history = [Message("user", U1), Message("assistant", two_turns["t1"].text)]
    s.messages = list(history)
    first = run_turn(s, s.send("Name one colour of the French flag."))
    old_prompt = conversation_ids(m, SYS, history + [Message("user", "Name one colour of the French flag.")])
    assert first.stats.prompt_tokens == len(old_prompt)

    edited_msg = "Name one colour of the Italian flag."
    new_prompt = conversation_ids(m, SYS, history + [Message("user", edited_msg)])
    lcp = common_prefix(old_prompt, new_prompt)
    assert len(history) > 0 and lcp < len(old_prompt)  # the edit diverges inside the old prompt
    edited = run_turn(s, s.edit_last_user(edited_msg))
    assert edited.stats.reused_tokens == lcp
    assert edited.stats.prefilled_tokens == len(new_prompt) - lcp
    assert edited.text == m.decode(greedy_ids(m, new_prompt, 6))
    assert s.messages == history + [Message("user", edited_msg), Message("assistant", edited.text)]

    again = run_turn(s, s.regenerate())
    # Same prompt: all of it is reused, with the logits its prefill left.
    assert again.stats.prompt_tokens == len(new_prompt)
    assert (again.stats.reused_tokens, again.stats.prefilled_tokens) == (len(new_prompt), 0)
    assert again.text == edited.text
    assert s.messages == history + [Message("user", edited_msg), Message("assistant", again.text)]


def test_regenerate_and_edit_without_a_user_message_raise(default_model):
    s = _session(default_model)
    with pytest.raises(ValueError):
        s.regenerate()
    with pytest.raises(ValueError):
        s.edit_last_user("x")
    assert s.messages == [] and s.cache.length == 0


# ---- streaming -----------------------------------------------------------------------------
MULTILINGUAL = 'Repeat exactly: "Voilà 🇫🇷 東京 👩‍👩‍👧 café"'


def test_streamed_pieces_are_whole_characters_and_add_up(default_model):
    m, n = default_model, 14
    tok = m.tokenizer
    s = _session(m, max_new_tokens=n)
    turn = run_turn(s, s.send(MULTILINGUAL))
    ids = greedy_ids(m, conversation_ids(m, SYS, [Message("user", MULTILINGUAL)]), n)
    full = tok.decode(ids, skip_special_tokens=True)
    assert turn.stats.completion_tokens == len(ids) == n
    assert "".join(turn.pieces) == turn.text == full
    assert all(p and "\ufffd" not in p for p in turn.pieces)
    # The reply really has characters split across tokens (else this test proves nothing).
    cuts = [i for i in range(1, n) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert cuts and "\ufffd" not in full, f"no multi-token character in {full!r}, or a broken one"
    assert any(ord(c) > 0x2E80 for c in full) and "à" in full

    # Cut inside a character by the length limit: the broken tail is not shown.
    s.settings = replace(s.settings, max_new_tokens=cuts[-1])
    cut = run_turn(s, s.regenerate())
    assert cut.finish.reason == "length"
    expected = tok.decode(ids[: cuts[-1]], skip_special_tokens=True).rstrip("\ufffd")
    assert "".join(cut.pieces) == cut.text == expected and len(expected) < len(full)
    assert all(p and "\ufffd" not in p for p in cut.pieces)
    assert s.messages[-1] == Message("assistant", cut.text)


# ---- stop strings --------------------------------------------------------------------------
STORY = "Tell me a short story about a dragon."


def _stop_across_a_token_boundary(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside the next, and the
    number of tokens after which the text first contains it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for i in range(3, len(ids) - 1):
        b = len(tokenizer.decode(ids[:i], skip_special_tokens=True))
        left, right = tokenizer.decode([ids[i - 1]]), tokenizer.decode([ids[i]])
        if len(left.strip()) < 3 or len(right.strip()) < 3 or not text.startswith(left, b - len(left)):
            continue
        stop = text[b - 2 : b + 2]
        if stop.strip() == stop and text.find(stop) == b - 2:
            n = next(j for j in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:j], skip_special_tokens=True))
            return stop, n
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


def test_stop_string_across_tokens_ends_the_reply_before_it(default_model):
    m, n = default_model, 14
    ids = greedy_ids(m, conversation_ids(m, SYS, [Message("user", STORY)]), n)
    text = m.decode(ids)
    stop, n_tokens = _stop_across_a_token_boundary(m.tokenizer, ids)
    assert n_tokens < len(ids)
    s = _session(m, max_new_tokens=n, stop_strings=(stop,))
    turn = run_turn(s, s.send(STORY))
    assert turn.finish.reason == "stop"
    assert turn.text == text[: text.index(stop)] == "".join(turn.pieces)
    assert all(stop not in p for p in turn.pieces) and stop not in turn.text
    # Generation stopped at the token that completed the stop string.
    assert turn.stats.completion_tokens == n_tokens
    assert s.messages[-1] == Message("assistant", turn.text)
    # Its ids hold the stop string the text lost: they are not kept, the next turn re-tokenizes the text.
    assert s.messages[-1].token_ids is None


# ---- cancel --------------------------------------------------------------------------------
LONG = " ".join(f"Fact {i}: the river number {i} flows into the sea near town {i}." for i in range(8))
LONG_Q = LONG + " Which river is number 3?"


def test_cancel_mid_prefill_keeps_exactly_the_prefilled_tokens(default_model):
    m, chunk = default_model, 32
    s = _session(m, max_new_tokens=4, prefill_chunk=chunk)

    def cancel_after_first_chunk(ev, pieces, progress):
        if isinstance(ev, PrefillProgress) and ev.done > 0:
            s.cancel()

    turn = run_turn(s, s.send(LONG_Q), cancel_after_first_chunk)
    prompt = conversation_ids(m, SYS, [Message("user", LONG_Q)])
    assert len(prompt) > 4 * chunk
    assert turn.finish.reason == "cancelled"
    assert turn.text == "" and turn.pieces == []
    assert [p.done for p in turn.progress] == [0, chunk]
    assert turn.stats.prompt_tokens == len(prompt)
    assert (turn.stats.reused_tokens, turn.stats.prefilled_tokens) == (0, chunk)
    assert s.cache.length == chunk
    assert s.messages == [Message("user", LONG_Q)]

    # Regenerating resumes from the 32 cached tokens and answers as a fresh session does.
    resumed = run_turn(s, s.regenerate())
    assert (resumed.stats.reused_tokens, resumed.stats.prefilled_tokens) == (chunk, len(prompt) - chunk)
    fresh = _session(m, max_new_tokens=4)
    f = run_turn(fresh, fresh.send(LONG_Q))
    assert resumed.finish.reason == f.finish.reason != "cancelled"
    assert resumed.text == f.text
    torch.testing.assert_close(s.last_logits, fresh.last_logits, atol=LOGITS_ATOL, rtol=1e-5)


def test_cancel_mid_decode_keeps_the_partial_reply(default_model):
    m = default_model
    s = _session(m, max_new_tokens=40)

    def cancel_after_third_piece(ev, pieces, progress):
        if isinstance(ev, TextPiece) and len(pieces) == 3:
            s.cancel()

    turn = run_turn(s, s.send(STORY), cancel_after_third_piece)
    st = turn.stats
    assert turn.finish.reason == "cancelled"
    assert len(turn.pieces) == 3 and turn.text == "".join(turn.pieces) != ""
    assert st.completion_tokens == 3  # the cancel lands before the next decode step
    assert s.messages == [Message("user", STORY), Message("assistant", turn.text)]
    # Every token that went through the model is cached: the prompt and all replies but the last.
    assert s.cache.length == st.prompt_tokens + st.completion_tokens - 1

    # The flag set above does not leak into the next reply, which matches a fresh session's.
    s.settings = replace(s.settings, max_new_tokens=4)
    nxt = run_turn(s, s.send("Go on."))
    assert nxt.finish.reason in ("stop", "length") and nxt.stats.reused_tokens > st.prompt_tokens
    fresh = _session(m, max_new_tokens=4)
    fresh.messages = list(s.messages[:2])
    f = run_turn(fresh, fresh.send("Go on."))
    assert nxt.text == f.text
    torch.testing.assert_close(s.last_logits, fresh.last_logits, atol=LOGITS_ATOL, rtol=1e-5)


def test_cancel_from_another_thread(default_model):
    s = _session(default_model, max_new_tokens=60)
    first_piece = threading.Event()
    result = {}

    def worker():
        result["turn"] = run_turn(s, s.send(STORY), lambda ev, *_: isinstance(ev, TextPiece) and first_piece.set())

    t = threading.Thread(target=worker)
    t.start()
    assert first_piece.wait(60)
    s.cancel()
    t.join(60)
    assert not t.is_alive()
    turn = result["turn"]
    assert turn.finish.reason == "cancelled"
    assert 1 <= turn.stats.completion_tokens < 10
    assert s.cache.length == turn.stats.prompt_tokens + turn.stats.completion_tokens - 1


def test_cancel_between_send_and_the_first_event_is_honoured(default_model):
    s = _session(default_model, max_new_tokens=4)
    events = s.send(U1)
    s.cancel()
    turn = run_turn(s, events)
    assert turn.finish.reason == "cancelled" and turn.text == ""
    assert turn.stats.prefilled_tokens == 0 and s.cache.length == 0


# ---- a message longer than the context -----------------------------------------------------
HUGE = "Please summarise this. " + "The quick brown fox jumps over the lazy dog. " * 20


@pytest.mark.parametrize("policy", OVERFLOW_POLICIES)
def test_oversized_message_raises_and_changes_nothing(default_model, policy):
    m = default_model
    s = _session(m, max_new_tokens=3, context_limit=128, overflow=policy)
    run_turn(s, s.send("Hi"))
    messages, length = list(s.messages), s.cache.length
    k0 = s.cache.k[0][:, :, :length].clone()
    need = len(conversation_ids(m, SYS, [Message("user", HUGE)]))
    assert need > 128
    with pytest.raises(ContextOverflowError) as err:
        run_turn(s, s.send(HUGE))
    assert (err.value.prompt_tokens, err.value.context_limit) == (need, 128)
    assert str(need) in str(err.value) and "128" in str(err.value) and "\n" not in str(err.value)
    assert s.messages == messages and s.cache.length == length
    assert torch.equal(s.cache.k[0][:, :, :length], k0)
    with pytest.raises(ContextOverflowError):
        run_turn(s, s.edit_last_user(HUGE))
    assert s.messages == messages and s.cache.length == length
    # The conversation goes on as if the message had never been sent.
    nxt = run_turn(s, s.send("Thanks!"))
    assert nxt.finish.reason in ("stop", "length") and nxt.stats.reused_tokens > 0
    assert nxt.stats.prompt_tokens == len(conversation_ids(m, SYS, s.messages[:-1]))


# ---- sampling ------------------------------------------------------------------------------
POEM = "Write a poem about the sea."


def test_temperature_zero_is_greedy_whatever_the_seed_and_filters(default_model, two_turns):
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=5)
    s = _session(default_model, max_new_tokens=N, sampling=greedy)
    turn = run_turn(s, s.send(U1))
    assert turn.text == two_turns["t1"].text  # itself the plain greedy loop's text


def test_same_seed_same_text(default_model, two_turns):
    m, n = default_model, 6
    hot = SamplingParams(temperature=1.5, seed=1234)
    s = _session(m, max_new_tokens=n, sampling=hot)
    first = run_turn(s, s.send(POEM)).text
    again = run_turn(s, s.regenerate()).text  # one generator per reply, seeded again
    assert first == again != ""
    # Sampling is really on: another seed, or this one, leaves the greedy path.
    other = _session(m, max_new_tokens=n, sampling=replace(hot, seed=7))
    texts = {first, run_turn(other, other.send(POEM)).text}
    greedy = m.decode(greedy_ids(m, conversation_ids(m, SYS, [Message("user", POEM)]), n))
    assert texts != {greedy}
