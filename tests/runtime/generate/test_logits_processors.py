"""OpenAI's frequency/presence penalties and the logprobs recorder (runtime.generate.logits_processors)."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.generate.logits_processors import LogprobsRecorder, PenaltyProcessor


def test_penalties_follow_openais_formula():
    p = PenaltyProcessor(frequency_penalty=0.5, presence_penalty=1.0)
    out = p([1, 1, 2], torch.zeros(5))
    # c = [0, 2, 1, 0, 0]: logit -= c * 0.5 + (c > 0) * 1.0
    assert out.tolist() == [0.0, -2.0, -1.5, 0.0, 0.0]
    # The next step counts only the new token on top of the old counts.
    out = p([1, 1, 2, 4], torch.zeros(5))
    assert out.tolist() == [0.0, -2.0, -1.5, 0.0, -1.5]


def test_penalties_out_of_range_raise():
    with pytest.raises(ValueError, match="between -2 and 2"):
        PenaltyProcessor(frequency_penalty=2.5)


def test_recorder_closes_each_step_with_the_sampled_token():
    rec = LogprobsRecorder(top=2)
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    lse = math.log(sum(math.exp(x) for x in logits.tolist()))
    rec([], logits)
    rec([1], logits)  # step 0 sampled token 1
    entries = rec.finish([1, 3])  # step 1 sampled token 3 (the last: closed by finish)
    assert [e.token_id for e in entries] == [1, 3]
    assert entries[0].logprob == pytest.approx(1.0 - lse) and entries[1].logprob == pytest.approx(3.0 - lse)
    assert [i for i, _ in entries[0].top] == [3, 2]
    assert entries[0].top[0][1] == pytest.approx(3.0 - lse)
