"""A conversation far longer than the context is trimmed in a few encodes, not one per turn.

Dropping one turn at a time would render and encode a 340 KB body of 10,000 one-letter
messages once per dropped turn (8,642 encodes, ~44 minutes). ``drop_oldest_turns``
estimates each message once and searches the turn starts; these tests
count what gets rendered (not seconds) and check the result is the one-turn-at-a-time
answer.
"""
from __future__ import annotations

import random
import time

import pytest

from runtime.generate.chat_format import Message, encode_messages, token_counter
from runtime.generate.context import (
    PromptCancelled,
    drop_oldest_turns,
    fit_prompt,
    trim_conversation,
)


def _letters(n: int) -> list[Message]:
    return [Message("user" if i % 2 == 0 else "assistant", "a") for i in range(n)]


class Encoder:
    """A stand-in template: 3 tokens of system prompt, 2 per message, one per word; it
    records how many messages it rendered in all."""

    def __init__(self) -> None:
        self.calls = self.rendered = 0

    def __call__(self, messages) -> list[int]:
        self.calls += 1
        self.rendered += len(messages)
        return [0] * (3 + sum(2 + len(m.content.split()) for m in messages))


def _words(texts) -> list[int]:
    return [len(t.split()) for t in texts]


def _one_turn_at_a_time(encode, messages, target, tail=()):
    """The old algorithm, as the reference answer."""
    msgs = list(messages)
    ids = encode(msgs) + list(tail)
    while len(ids) > target and len(msgs) > 1:
        del msgs[0]
        while len(msgs) > 1 and msgs[0].role != "user":
            del msgs[0]
        ids = encode(msgs) + list(tail)
    return ids


def _kept(budget: int) -> int:
    """Messages of ``_letters`` whole turns that fit ``budget`` under :class:`Encoder`."""
    return max(k for k in range(1, 10_002, 2) if 3 + 3 * k <= budget)


def test_ten_thousand_messages_render_little_more_than_what_is_kept():
    msgs = _letters(10_001)
    enc = Encoder()
    ids, dropped, first = fit_prompt(enc, msgs, limit=8192, reserve=1024, policy="truncate-middle", count=_words)
    assert len(ids) == 3 + 3 * _kept(8192 - 1024) and first == 10_001 - _kept(8192 - 1024)
    assert dropped == 3 + 3 * 10_001 - len(ids)
    # The old way rendered ~8,600 conversations (~43 million messages).
    assert enc.calls <= 12 and enc.rendered <= 4 * _kept(8192 - 1024), (enc.calls, enc.rendered)


def test_without_estimates_the_search_still_takes_a_few_encodes():
    enc = Encoder()
    ids = drop_oldest_turns(enc, _letters(10_001), 2048)
    assert len(ids) == 3 + 3 * _kept(2048)
    assert enc.calls <= 14  # log2(5,001 turn starts) + 1


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("estimated", [True, False], ids=["estimated", "searched"])
def test_the_same_turns_are_kept_as_one_at_a_time(seed, estimated):
    rng = random.Random(seed)
    roles = ["user", "assistant"]
    msgs = [Message(rng.choice(roles) if i else "user", "w " * rng.randint(0, 30))
            for i in range(rng.randint(1, 60))]
    msgs.append(Message("user", "w " * rng.randint(0, 10)))
    target, tail = rng.randint(5, 400), [7] * rng.randint(0, 20)
    # A count that is off by up to 2 tokens a message: the search must still land exactly.
    noisy = lambda texts: [max(0, n + rng.randint(-2, 2)) for n in _words(texts)]  # noqa: E731
    count = noisy if estimated else None
    want = _one_turn_at_a_time(Encoder(), msgs, target, tail)
    ids, dropped, first = trim_conversation(Encoder(), msgs, target, tail, count=count)
    assert ids == want
    assert ids == (list(Encoder()(msgs[first:])) + tail if first else ids)   # the first message kept
    exact = len(Encoder()(msgs)) - (len(ids) - len(tail))
    if not estimated or dropped == 0:
        assert dropped == exact
    else:  # the dropped part is estimated when the whole was not rendered
        # (off by the noise: up to 2 a message, and up to 4 more through the measured template)
        assert abs(dropped - exact) <= 6 * len(msgs)


def test_a_cancel_stops_the_trimming():
    calls = []
    with pytest.raises(PromptCancelled):
        drop_oldest_turns(Encoder(), _letters(1001), 100, cancelled=lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3


@pytest.mark.slow
def test_the_default_model_trims_ten_thousand_messages_in_a_few_encodes(default_model):
    from runtime.generate.events import GenerationSettings
    from runtime.generate.session import ChatSession

    tok = default_model.tokenizer
    rendered = []

    class Counting(ChatSession):
        def _encode(self, messages):
            rendered.append(len(messages))
            return super()._encode(messages)

    s = Counting(default_model, settings=GenerationSettings(max_new_tokens=2, context_limit=512))
    s.messages = _letters(10_000)
    t0 = time.perf_counter()
    finish = s.run(s.send("a"))
    seconds = time.perf_counter() - t0
    assert finish.reason in ("stop", "length")
    # The prompt is the whole turns that fit with room for the reply (2 tokens), as
    # dropping one turn at a time would keep: two more messages would not fit.
    prompt = s.cached_token_ids[: finish.stats.prompt_tokens]
    n = prompt.count(tok.convert_tokens_to_ids("<|im_start|>")) - 2  # the default system prompt, the reply's
    assert encode_messages(tok, _letters(10_001)[-n:]) == prompt
    assert len(encode_messages(tok, _letters(10_001)[-(n + 2):])) > 512 - 2 >= len(prompt)
    assert finish.stats.dropped_tokens > 60_000
    # Few renders, none of the whole conversation; seconds are printed, not asserted.
    assert len(rendered) <= 16 and max(rendered) < 10_001, rendered
    print(f"trimmed 10,001 messages in {seconds:.2f} s ({len(rendered)} encodes)")
    assert token_counter(tok)(["a", "hello world"]) == [1, 2]
