"""Rolling overflow keeps the system prompt with the sinks (StreamingLLM's sinks are the first
tokens: here they reach the end of the system prompt) and reports the messages the model no
longer sees; a system prompt longer than half the context is said to be lost."""
from __future__ import annotations

import pytest

from runtime import ChatSession, GenerationSettings, SamplingParams
from runtime.generate.context import rolling_sinks, system_prompt_tokens, unseen_messages

SYSTEM = "Be brief, be kind."


def test_the_sinks_reach_the_end_of_the_system_prompt_when_it_fits():
    assert rolling_sinks(20, 4, 100) == (20, True)
    assert rolling_sinks(3, 4, 100) == (4, True)           # within the usual 4 sinks anyway
    assert rolling_sinks(51, 4, 100) == (4, False)         # more than half the context: lost, and said
    assert rolling_sinks(20, 4, 100, keep_system=False) == (4, False)


def test_unseen_messages_counts_whole_messages_before_the_first_kept_token():
    slots = [0, 1, 2, 3, *range(50, 100)]                  # 4 sinks, then positions 50..99
    ends = lambda k: 10 + 20 * k                            # noqa: E731 - message k ends at 10 + 20 k
    assert unseen_messages(slots, 4, 6, ends) == 2         # ends 30 and 50 are before 50
    assert unseen_messages(list(range(60)), 4, 6, ends) == 0   # nothing evicted
    assert unseen_messages(slots, 4, 1, ends) == 1


def test_system_prompt_tokens_is_the_common_start():
    enc = lambda msgs: [9, 9, 9, 7] + [ord(c) for m in msgs for c in m.content] + [0]   # noqa: E731
    assert system_prompt_tokens(enc) == 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=256),
                      device="cpu", dtype="float32")


def run(session, text):
    return session.run(session.send(text))


@pytest.mark.parametrize("keep", [True, False])
def test_rolling_keeps_the_system_prompt_and_says_what_the_model_no_longer_sees(tiny, keep):
    settings = GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=24, context_limit=128,
                                  overflow="rolling", sink_tokens=4, keep_system_prompt=keep)
    s = ChatSession(tiny, system_prompt=SYSTEM, settings=settings)
    n_system = system_prompt_tokens(s._encode)
    assert 4 < n_system <= 64
    finishes = [run(s, f"turn {i}: the cat sat on the mat and looked at the dog") for i in range(8)]
    last = finishes[-1].stats
    assert s.cache.length <= 128 and last.sink_tokens == (n_system if keep else 4)
    assert last.system_kept is keep
    kept = s.cached_token_ids
    stream = s.kv.stream
    if keep:   # the cache still starts with the whole system prompt (it was cut after 4 tokens)
        assert kept[:n_system] == stream[:n_system]
    assert kept[:4] == stream[:4] and len(stream) > 128 * 2   # long past the window
    # The first messages are out of the window: counted, and consistent with the cache.
    assert 1 <= last.unseen_messages < len(s.messages) and last.unseen_policy == "rolling"
    assert [f.stats.unseen_messages for f in finishes] == sorted(f.stats.unseen_messages for f in finishes)
