"""Explain reads what the KV cache held (runtime.insight.attention_view.held_context): after
rolling overflow the model predicted a reply token from the sinks and the newest window, not
from the whole stored conversation."""
from __future__ import annotations

import pytest

from runtime import ChatSession, GenerationSettings, SamplingParams, context_ids, held_context


def test_a_prefix_and_one_later_run_give_the_model_s_context():
    conv = list(range(100, 140))                      # 40 distinct ids
    held = conv[:4] + conv[25:38]                     # 4 sinks, then positions 25..37
    assert held_context(conv, held, 37) == [0, 1, 2, 3, *range(25, 37)]
    assert held_context(conv, held, 39) == [0, 1, 2, 3, *range(25, 39)]   # tokens after the run: written later
    assert held_context(conv, held, 20) is None       # before the run: the cache held another context then
    assert held_context(conv, conv[:30], 29) is None  # nothing dropped: the conversation itself
    assert held_context(conv, [7, 8, 9], 10) is None  # nothing in common
    assert held_context(conv, conv[:4] + [1, 2, 3], 30) is None   # not a run of the conversation


def test_the_newest_match_is_taken_when_the_run_repeats():
    conv = [1, 2, 3, 9, 9, 5, 6, 9, 9, 5, 6]          # "9 9 5 6" twice
    assert held_context(conv, [1, 2, 9, 9, 5, 6], 10) == [0, 1, 7, 8, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=256),
                      device="cpu", dtype="float32")


def test_after_rolling_the_context_is_what_the_cache_held(tiny):
    settings = GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=24, context_limit=128,
                                  overflow="rolling", sink_tokens=4)
    s = ChatSession(tiny, settings=settings)
    for i in range(6):
        s.run(s.send(f"turn {i}: the cat sat on the mat and looked at the dog"))
    held, stream = context_ids(s), s.kv.stream   # the session's own token stream (the template's, as it ran)
    assert len(stream) > 2 * 128 and len(held) <= 128   # long past the window
    t = len(stream) - 1   # the newest token
    positions = held_context(stream, held, t)
    assert positions is not None and len(positions) < t     # tokens the model no longer saw are left out
    assert [stream[p] for p in positions] == held[:len(positions)]   # exactly the ids the cache held before it
    assert positions[:4] == [0, 1, 2, 3]                              # the sinks
