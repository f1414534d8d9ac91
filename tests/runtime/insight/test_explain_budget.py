"""Explain within bounds: integrated gradients batched within a memory
budget, a 16-bit model's weights not widened for the backward pass, a moving window of
positions, progress and Cancel, the cost said before it starts."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.insight import gradients as ex_mod
from runtime.insight.explain import (
    ExplainCancelled,
    explain_cost,
    explain_token,
    gradient_importance,
    ig_batch,
    pass_bytes,
)
from runtime.model import layers

IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(path, device="cpu", dtype="float32"), load_model(path, device="cpu", dtype="float16")


def test_a_16_bit_weight_keeps_its_own_dtype_for_the_backward_pass():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(24, 16).to(torch.float16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        y = layers.linear(x, w, path="cpu")
    assert all(t.dtype != torch.float32 or t.shape != (24, 16) for t in saved)   # no float32 copy of w kept
    (g,) = torch.autograd.grad(y.square().sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w.float())
    (g2,) = torch.autograd.grad(y2.square().sum(), x2)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(g, g2)


def test_gradients_of_a_float16_model_match_its_float32_twin(tiny_pair):
    f32, f16 = tiny_pair
    a, lp_a = gradient_importance(f32, IDS, 8)
    b, lp_b = gradient_importance(f16, IDS, 8)
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0.05, atol=0.02)   # weights rounded to 16 bits
    assert lp_b == pytest.approx(lp_a, abs=0.05)


def test_steps_run_in_batches_the_budget_holds_and_give_the_same_result(tiny_pair, monkeypatch):
    model = tiny_pair[0]
    batches = []
    real = ex_mod._logprob_grads
    monkeypatch.setattr(ex_mod, "_logprob_grads", lambda m, ctx, tok, alphas, *rest: (
        batches.append(alphas.numel()), real(m, ctx, tok, alphas, *rest))[1])
    per = pass_bytes(model, 8)
    monkeypatch.setattr(ex_mod, "IG_BUDGET_BYTES", 3 * per)
    assert ig_batch(model, 8, 3 * per) == 3 and ig_batch(model, 8, per // 2) == 1   # one at least
    got, _ = gradient_importance(model, IDS, 8, method="integrated_gradients", steps=8,
                                 chunk=ig_batch(model, 8, 3 * per))
    assert batches == [3, 3, 2, 2]   # the steps in threes, then log p at both ends of the path
    want, _ = gradient_importance(model, IDS, 8, method="integrated_gradients", steps=8, chunk=8)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    batches.clear()
    gradient_importance(model, IDS, 8, method="integrated_gradients", steps=9, rule="adaptive", chunk=3)
    assert max(batches) == 3 and sum(batches) <= 9
    # Activations grow with the tokens; steps over a few moving tokens keep less than a whole pass.
    assert pass_bytes(model, 64) == 2 * pass_bytes(model, 32) > 0
    assert pass_bytes(model, 8, keys=64) < pass_bytes(model, 64)


def test_only_the_last_positions_move_and_completeness_holds(tiny_pair):
    model = tiny_pair[0]
    t = 10
    got, base_lp = gradient_importance(model, IDS, t, method="integrated_gradients", steps=32, positions=3)
    assert got[:t - 3] == [0.0] * (t - 3) and all(v != 0 for v in got[t - 3:])
    _, lp = gradient_importance(model, IDS, t)
    assert sum(got) == pytest.approx(lp - base_lp, abs=0.02 * max(1.0, abs(lp - base_lp)))
    e = explain_token(model, IDS, t, layer=1, head=2, ig_steps=16, permutations=4, ig_positions=3)
    assert e.ig_positions == 3 and e.integrated_gradients[:t - 3] == [0.0] * (t - 3)
    assert explain_token(model, IDS, 4, layer=1, head=2, ig_steps=3, permutations=2, ig_positions=50).ig_positions == 3


def test_progress_counts_every_pass_and_cancel_stops_between_batches(tiny_pair):
    model = tiny_pair[0]
    cost = explain_cost(model, 8, ig_steps=6, permutations=5)
    assert cost["passes"] == 1 + 6 + 5   # input x gradient, at most 6 steps, 5 permutations
    assert cost["typical_token_passes"] == cost["token_passes"]   # 6 steps: fewer than the typical
    longer = explain_cost(model, 300, ig_steps=97, permutations=32)
    assert longer["typical_token_passes"] < longer["token_passes"]
    assert cost["peak_bytes"] == max(pass_bytes(model, 8), pass_bytes(model, 7, keys=8) * min(cost["batch"], 6))
    seen = []
    explain_token(model, IDS, 8, layer=0, head=1, ig_steps=6, permutations=5, progress=lambda d, n: seen.append((d, n)))
    assert seen[-1] == (cost["passes"], cost["passes"]) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    stop_after = seen[1][0]
    calls = []
    with pytest.raises(ExplainCancelled):
        explain_token(model, IDS, 8, layer=0, head=1, ig_steps=6, permutations=5,
                      progress=lambda d, n: calls.append(d), cancelled=lambda: bool(calls) and calls[-1] >= stop_after)
    assert calls[-1] == stop_after   # nothing ran after the cancel was seen


def test_the_rate_is_timed_from_a_gradient_pass(tiny_pair, monkeypatch):
    """Explain's time is said in no-gradient forwards of one token (explain_work): the rate is
    one input x gradient pass's time over its 2.5 forwards per token, in widened weights."""
    from runtime.insight import explain as explain_mod

    model = tiny_pair[0]
    calls = []
    real = ex_mod._logprob_grads
    monkeypatch.setattr(ex_mod, "_logprob_grads", lambda *a: (calls.append(a[1].shape), real(*a))[1])
    ticks = iter([10.0, 13.0])
    rate = explain_mod.explain_rate(model, IDS, 8, clock=lambda: next(ticks))
    assert rate == pytest.approx(3.0 / (explain_mod.GRADIENT_PASS_FORWARDS * 8))
    assert calls == [(1, 8)]   # one pass over the 8 context tokens
