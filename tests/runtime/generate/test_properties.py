"""Property-based tests (hypothesis) of prefix reuse and conversation rendering, on a tiny model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import ChatSession, GenerationSettings, Message, load_model
from runtime.generate.chat_format import encode_messages, render
from tests.runtime.tiny_models import WORDS, make_tiny_model

text = st.lists(st.sampled_from(WORDS + ["?", "!", "é", "東", "🙂", "  ", "\n"]), min_size=1, max_size=12).map(" ".join)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024), device="cpu", dtype="float32")


def conversation(draw_texts: list[str]) -> list[Message]:
    roles = ["user", "assistant"]
    return [Message(roles[i % 2], t) for i, t in enumerate(draw_texts)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(text, min_size=3, max_size=7).filter(lambda t: len(t) % 2 == 1), data=st.data())
def test_random_edit_of_an_earlier_message_gives_a_fresh_sessions_logits(tiny, texts, data):
    msgs = conversation(texts)
    warm = ChatSession(tiny, settings=GenerationSettings(max_new_tokens=1))
    warm.messages = msgs[:-1]
    warm.run(warm.send(msgs[-1].content))
    # Edit one earlier message at random, then ask again.
    i = data.draw(st.integers(0, len(msgs) - 2), label="edited message")
    edited = list(msgs)
    edited[i] = Message(msgs[i].role, data.draw(text, label="new text"))
    warm.messages = edited[:-1]
    finish = warm.run(warm.send(edited[-1].content))
    cold = ChatSession(tiny, settings=GenerationSettings(max_new_tokens=1))
    cold.messages = edited[:-1]
    cold.run(cold.send(edited[-1].content))
    torch.testing.assert_close(warm.last_logits, cold.last_logits, atol=1e-5, rtol=1e-5)
    # Exactly the common token prefix was reused: at most all but one prompt token, or all of it
    # when the "edit" left the prompt as it was (its prefill's logits are kept).
    prompt = encode_messages(tiny.tokenizer, edited)
    assert warm.last_stats.prompt_tokens == len(prompt)
    assert 0 <= warm.last_stats.reused_tokens < len(prompt) or (edited == msgs and warm.last_stats.prefilled_tokens == 0)
    # A length stop feeds its one sampled token to the cache (the next turn needs it; not
    # when the token held only part of a character); an end-of-turn token does not stay.
    assert warm.cache.length - len(prompt) in ((0, 1) if finish.reason == "length" else (0,))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(text, min_size=1, max_size=6), k=st.integers(0, 6))
def test_rendering_of_a_conversation_extends_its_prefix(tiny, texts, k):
    """A longer conversation's prompt starts with a shorter one's (what prefix reuse relies on)."""
    msgs = conversation(texts)
    k = min(k, len(msgs))
    short = render(tiny.tokenizer, msgs[:k], add_generation_prompt=False)
    full = render(tiny.tokenizer, msgs, add_generation_prompt=True)
    assert full.startswith(short)
    # Every message's text appears, in order.
    pos = 0
    for m in msgs:
        pos = full.index(m.content, pos) + len(m.content)
    ids = encode_messages(tiny.tokenizer, msgs)
    assert tiny.tokenizer.decode(ids) == full


@settings(max_examples=30, deadline=None)
@given(texts=st.lists(text, min_size=1, max_size=4))
def test_plain_format_without_a_chat_template(texts):
    class NoTemplate:
        chat_template = None

    msgs = [Message("system", "be brief")] + conversation(texts)
    out = render(NoTemplate(), msgs)
    # Plain completion: the system prompt, a blank line, then the texts as they are.
    assert out == "be brief\n\n" + "".join(m.content for m in msgs[1:])
