"""The insight tests on the real default model (truth), kept small for ``make test``:
Olsson et al.'s induction-head ablation, and both of Jain and Wallace's tests on a short input."""
from __future__ import annotations

import pytest
import torch

from runtime.insight.ablation import induction_ablation
from runtime.insight.explain import explain_token
from runtime.insight.probe import head_scores

pytestmark = pytest.mark.slow


def test_knocking_out_induction_heads_hurts_the_repeated_half_more_than_random_heads(default_model):
    # The atlas on seed 0, the test tokens on seed 1 (the heads are not chosen on them).
    scores = head_scores(default_model, repeat_len=20, batch=2, seed=0)
    r = induction_ablation(default_model, scores=scores, n_heads=5, mode="mean", repeat_len=20, batch=2, seed=1,
                           controls=2)
    assert r.baseline_second < r.baseline_first - 5  # the model copies: the second half is far easier
    rise = r.induction_second - r.baseline_second
    assert all(rise > 3 * max(s - r.baseline_second, 0.1) for s in r.random_second), r


def test_explain_a_token_of_the_default_model(default_model):
    ids = default_model.encode("The cat sat on the mat. The cat sat on the") + default_model.encode(" mat")
    ex = explain_token(default_model, ids, -1, layer=17, head=3, ig_steps=4, permutations=4)
    with torch.inference_mode():
        want = torch.log_softmax(default_model.logits(ids[:-1])[0, -1], -1)[ids[-1]]
    assert ex.log_prob == pytest.approx(float(want), abs=1e-4)
    assert ex.log_prob > -3  # " mat" is likely after the repeat
    assert sum(ex.attention) == pytest.approx(1.0, abs=1e-4) and len(ex.attention) == len(ids) - 1
    assert ex.integrated_gradients[0] == 0.0  # the first token stays in the baseline
    assert all(v != 0 for v in ex.input_x_gradient)
    assert -1 <= ex.tau_input_x_gradient <= 1 and -1 <= ex.tau_integrated_gradients <= 1
    assert 0 <= ex.permutation.median_tv <= 1 and len(ex.permutation.tv) == 4
