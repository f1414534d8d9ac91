"""The KV panel's rolling forecast against what the session really evicts (tiny seeded llama).

The readout said "rolling evicts the oldest 122 tokens" and then marked "evicted 118": the
points come every 4 decoded tokens, and the mark was the difference of two points, short by
the tokens written between them. The forecast was right; the mark now counts those tokens.
"""
from __future__ import annotations

import re

import pytest
import torch

from desktop.panels.kv.series import KVSeries, policy_next
from runtime import ChatSession, GenerationSettings, StatsUpdate, load_model
from tests.runtime.tiny_models import WORDS, make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("rolling"), "llama", max_positions=1024),
                      device="cpu", dtype="float32")


def test_the_eviction_mark_is_the_forecast_and_the_truth(model):
    limit, sinks = 500, 12
    banned = torch.arange(260)   # no end of turn, no lone bytes: the reply runs past the limit

    def no_stop(generated, row):
        return row.index_fill(0, banned, float("-inf"))

    st = GenerationSettings(max_new_tokens=600, context_limit=limit, overflow="rolling", sink_tokens=sinks,
                            logits_processors=(no_stop,))
    s = ChatSession(model, settings=st)
    cut = []   # (length before, length after) of every cut the cache really made
    remove = s.cache.remove_span
    s.cache.remove_span = lambda a, b: (cut.append((s.cache.length, s.cache.length - (b - a))), remove(a, b))
    series, forecast = KVSeries(), []
    for ev in s.send(" ".join(WORDS[:60])):
        if isinstance(ev, StatsUpdate):
            d = dict(ev.stats.to_dict(), conv_id=1, request=1)
            series.add(d, "rolling")
            if not series.events:
                line = policy_next("rolling", series.tokens[-1], limit, series.sink_tokens)
                forecast.append(int(re.search(r"oldest ([\d,]+) tokens", line).group(1).replace(",", "")))
    assert len(cut) >= 2 and series.sink_tokens == sinks
    truth = [b - a for b, a in cut]
    assert truth[0] == (limit - sinks) // 4 == forecast[-1] == 122
    marks = [b - a for b, a, _ in series.events]
    assert marks == truth and [b for b, _, _ in series.events] == [b for b, _ in cut] == [limit] * len(cut)
