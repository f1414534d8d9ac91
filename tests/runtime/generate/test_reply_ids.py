"""A conversation keeps the token ids its replies were generated as, and the next prompt is
built from them: turn 2 prefills only the template's end-of-turn and the new message.

Two levels: the prompt assembly over generated-like replies (lists, code, numbers,
whitespace runs, emoji) written as token sequences the tokenizer would not produce from
the text, with the real default tokenizer; and whole turns on a tiny seeded random model
whose replies are arbitrary token sequences.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import ChatSession, GenerationSettings, Message, load_model
from runtime.generate.chat_format import encode_conversation
from tests.runtime.tiny_models import WORDS, make_tiny_model

SYS = "You are a helpful assistant."
ChatML_NEXT = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

lists = st.lists(st.sampled_from(["Paris", "a river", "42 km", "**bold**"]), min_size=1, max_size=4).map(
    lambda items: "\n\n".join(f"{i + 1}. {x}" for i, x in enumerate(items)))
code = st.sampled_from(["```python\ndef f(x):\n    return x + 1\n```", "`x = [1, 2]`", "```\n  indented\n\tTab\n"])
numbers = st.integers(-10**9, 10**9).map(str) | st.floats(allow_nan=False, allow_infinity=False).map(repr)
spaces = st.sampled_from([" ", "  ", "\n", "\n\n", "\n\n\n", "\t", " \n "]).flatmap(
    lambda w: st.integers(1, 4).map(lambda n: w * n))
emoji = st.sampled_from(["🙂", "🎉🎉", "東京", "é", "👩‍👩‍👧", "ﬁ"])
reply_text = st.lists(lists | code | numbers | spaces | emoji | st.sampled_from(WORDS), min_size=1, max_size=8).map("".join)


@st.composite
def written(draw, tokenizer):
    """A reply text and a token sequence for it as a model may write it: the text cut at
    random points, each piece tokenized alone (so merges across the cuts are missed, as
    when the model writes "\\n\\n" as one token where the tokenizer would write two)."""
    text = draw(reply_text)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b]
    return text, tuple(i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), user2=reply_text)
def test_turn2_prompt_is_turn1_prompt_then_the_written_ids_then_only_the_new_message(default_model, data, user2):
    tok = default_model.tokenizer
    text, ids = data.draw(written(tok), label="reply")
    assert tok.decode(list(ids)) == text
    turn1 = encode_conversation(tok, [Message("system", SYS), Message("user", "Tell me something.")]).ids
    conv = [Message("system", SYS), Message("user", "Tell me something."), Message("assistant", text, ids),
            Message("user", user2)]
    turn2 = encode_conversation(tok, conv)
    assert turn2.ids[: len(turn1) + len(ids)] == turn1 + list(ids)
    assert turn2.ids[len(turn1) + len(ids):] == tok.encode(ChatML_NEXT.format(user2), add_special_tokens=False)
    assert turn2.retokenized_tokens == 0


@pytest.mark.slow
def test_the_models_paragraph_break_survives_where_re_tokenizing_loses_it(default_model):
    """SmolLM2 writes "\\n\\n" before "2." as one token (1116); its tokenizer re-encodes it as 198, 198."""
    tok = default_model.tokenizer
    ids = (*tok.encode("1. Paris", add_special_tokens=False), 1116, *tok.encode("2. Rome", add_special_tokens=False))
    text = tok.decode(list(ids))
    assert text == "1. Paris\n\n2. Rome"
    conv = [Message("user", "Two cities?"), Message("assistant", text, ids), Message("user", "More.")]
    plain = encode_conversation(tok, [*conv[:1], Message("assistant", text), conv[2]])
    spliced = encode_conversation(tok, conv)
    assert 1116 in spliced.ids and 1116 not in plain.ids   # re-tokenizing would have broken the cache there
    assert plain.retokenized_tokens == len(tok.encode(text, add_special_tokens=False)) and spliced.retokenized_tokens == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024), device="cpu", dtype="float32")


words = st.lists(st.sampled_from(WORDS + ["?", "🙂", "\n\n", "  ", "3.5"]), min_size=1, max_size=10).map(" ".join)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user1=words, user2=words, n=st.integers(1, 24))
def test_turn2_prefills_only_the_new_message_plus_template_tokens(tiny, user1, user2, n):
    """A random model's reply is an arbitrary token sequence; the next turn reuses all of it."""
    s = ChatSession(tiny, system_prompt=SYS, settings=GenerationSettings(max_new_tokens=n))
    first = s.run(s.send(user1))
    cached = s.cache.length
    reply = s.messages[-1]
    assert reply.role == "assistant"
    # Model.decode drops special tokens, as the shown text does (a random model may write [UNK]).
    assert reply.token_ids is not None and tiny.decode(reply.token_ids) == reply.content
    # All of them, but for the bytes of a character a length stop cut (not in the text).
    cut = first.stats.completion_tokens - len(reply.token_ids)
    assert cut == 0 or first.reason == "length"
    second = s.run(s.send(user2))
    new_part = tiny.tokenizer.encode(ChatML_NEXT.format(user2), add_special_tokens=False)
    # Turn 2's prompt: turn 1's, the reply's ids, the template's end-of-turn and the new message.
    written = len(reply.token_ids)
    assert second.stats.prompt_tokens == first.stats.prompt_tokens + written + len(new_part)
    # All of it was cached (a length stop feeds its last token at the stop), and is reused.
    fed = cached - first.stats.prompt_tokens
    assert fed >= written
    assert second.stats.reused_tokens == first.stats.prompt_tokens + written
    assert second.stats.prefilled_tokens == len(new_part)
    assert second.stats.retokenized_tokens == 0


def test_a_template_that_rewrites_replies_gets_the_re_tokenized_prompt(tiny):
    """A template that trims earlier replies (as some drop their reasoning) does not place
    the text the ids stand for: the ids are not spliced, and the stats say so."""
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = tok.chat_template.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
    text = "  the end  "
    ids = tuple(tok.encode(text, add_special_tokens=False))
    conv = [Message("user", "hi"), Message("assistant", text, ids), Message("user", "and")]
    got = encode_conversation(tok, conv)
    assert got.ids == tok.encode(tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in conv], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    assert got.retokenized_tokens == len(ids)


def test_an_edited_reply_is_re_tokenized_and_counted(tiny):
    s = ChatSession(tiny, settings=GenerationSettings(max_new_tokens=4))
    s.messages = [Message("user", "hi"), Message("assistant", "what the user typed")]
    done = s.run(s.send("and"))
    assert done.stats.retokenized_tokens == len(tiny.tokenizer.encode("what the user typed", add_special_tokens=False))


@pytest.fixture(scope="module")
def only_words(tiny):
    """A logits processor: a random model's greedy pick is a byte token that decodes to
    nothing; this one makes it write the tokenizer's words."""
    mask = torch.full((tiny.config.vocab_size,), float("-inf"))
    mask[list(set(tiny.tokenizer.encode(" ".join(WORDS), add_special_tokens=False)))] = 0.0
    return lambda ids, logits: logits + mask


def test_a_length_stop_feeds_its_last_token_so_turn2_prefills_only_the_new_message(tiny, only_words):
    """A length stop feeds its last sampled token, so the cache holds the whole reply when the
    turn ends and the second turn prefills only the new message's tokens."""
    s = ChatSession(tiny, system_prompt=SYS, settings=GenerationSettings(max_new_tokens=5,
                                                                          logits_processors=(only_words,)))
    first = s.run(s.send("the cat"))
    assert first.reason == "length" and first.stats.completion_tokens == 5
    reply = s.messages[-1]
    assert len(reply.token_ids) == 5
    assert s.cache.length == first.stats.prompt_tokens + 5
    assert s.cached_token_ids[-5:] == list(reply.token_ids) == list(first.token_ids)
    assert first.stats.kv_cache["tokens"] == s.cache.length   # the Finish's figures include it
    second = s.run(s.send("and then"))
    new_part = tiny.tokenizer.encode(ChatML_NEXT.format("and then"), add_special_tokens=False)
    assert second.stats.reused_tokens == first.stats.prompt_tokens + 5
    assert second.stats.prefilled_tokens == len(new_part)


def test_editing_the_first_of_three_turns_reuses_the_cache_up_to_the_first_changed_token(tiny, only_words):
    tok = tiny.tokenizer
    s = ChatSession(tiny, system_prompt=SYS, settings=GenerationSettings(max_new_tokens=4,
                                                                          logits_processors=(only_words,)))
    for text in ("the cat is here", "and the dog", "or a bird"):
        s.run(s.send(text))
    assert [m.role for m in s.messages] == ["user", "assistant"] * 3
    old = encode_conversation(tok, [Message("system", SYS), Message("user", "the cat is here")]).ids
    new = encode_conversation(tok, [Message("system", SYS), Message("user", "the cat is there")]).ids
    assert s.cached_token_ids[: len(old)] == old
    lcp = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    assert 0 < lcp < len(new)

    edited = s.run(s.edit(0, "the cat is there"))
    # Everything before the first changed token comes from the cache; only the rest is prefilled.
    assert (edited.stats.prompt_tokens, edited.stats.reused_tokens, edited.stats.prefilled_tokens) == (
        len(new), lcp, len(new) - lcp)
    assert [(m.role, m.content) for m in s.messages] == [("user", "the cat is there"), ("assistant", edited.text)]
    assert s.cached_token_ids == new + list(edited.token_ids)   # the dropped turns left the cache too


def test_editing_a_message_that_is_not_a_users_raises_and_changes_nothing(tiny):
    s = ChatSession(tiny, settings=GenerationSettings(max_new_tokens=2))
    s.messages = [Message("user", "hi"), Message("assistant", "there")]
    for index in (1, 2, -1):
        with pytest.raises(ValueError, match="is not a user message"):
            s.edit(index, "x")
    assert s.messages == [Message("user", "hi"), Message("assistant", "there")]
