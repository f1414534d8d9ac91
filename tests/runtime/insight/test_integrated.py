"""Integrated gradients over a frozen prefix with the adaptive rule (runtime.insight.integrated):
the prefix's passes equal the whole window's, the rule on a path whose integral is known,
its self-check on a tiny model, quantized matrices widened once per Explain."""
from __future__ import annotations

import math

import pytest
import torch

from runtime import load_model
from runtime.insight import gradients as G
from runtime.insight.integrated import adaptive_simpson, frozen_prefix
from runtime.model import quant_layers
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata
from tests.runtime.tiny_models import WINDOW, make_tiny_model

IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]   # longer than a sliding window


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "gemma2"])
def test_passes_after_a_frozen_prefix_equal_the_whole_window(tmp_path, family):
    """Sliding windows (gemma: WINDOW tokens), learned positions (gpt2), soft-capping (gemma2):
    the tokens after the prefix attend to its kept keys exactly as in one forward."""
    assert len(IDS) > 2 * WINDOW
    model = load_model(make_tiny_model(tmp_path, family), device="cpu", dtype="float32")
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        want = model.decoder(ids, last_only=True)
    for keep in (1, 5, 13):
        got = model.decoder(ids[:, keep:], frozen_prefix(model, ids[:, :keep], chunk=4), last_only=True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        x = G._embeddings(model, ids)
        lp, g = G._logprob_grads(model, ids[:, keep:], IDS[-1], torch.ones(1), x[keep:], torch.zeros_like(x[keep:]),
                                 frozen_prefix(model, ids[:, :keep], x[:keep], chunk=3))
        lp_all, g_all = G._logprob_grads(model, ids, IDS[-1], torch.ones(1), x, torch.zeros_like(x))
        assert float(lp[0]) == pytest.approx(float(lp_all[0]), abs=1e-4)
        torch.testing.assert_close(g[0], g_all[0, keep:], rtol=1e-3, atol=1e-4)   # the moving tokens' gradients


def _known_path(turns):
    """f(alpha) = sum_j tanh(k_j (alpha - c_j)): token j's share of the integral is f_j(1) - f_j(0)."""
    k = torch.tensor([kj for kj, _ in turns], dtype=torch.float64)
    c = torch.tensor([cj for _, cj in turns], dtype=torch.float64)
    seen = []

    def evaluate(alphas):
        seen.extend(alphas)
        a = torch.tensor(alphas, dtype=torch.float64).view(-1, 1)
        f = torch.tanh(k * (a - c))            # (S, P)
        return f.sum(-1).tolist(), (k * (1 - f ** 2)).float()   # d_j = f_j'
    exact = (torch.tanh(k * (1 - c)) - torch.tanh(-k * c)).float()
    return evaluate, exact, seen


def test_the_adaptive_rule_on_a_path_whose_integral_is_known():
    turns = [(60.0, 0.71), (3.0, 0.4), (25.0, 0.23)]   # two sharp turns, one gentle
    evaluate, exact, seen = _known_path(turns)
    got, f0, f1, gap, n = adaptive_simpson(evaluate, steps=97, batch=4, tolerance=0.01)
    assert n == len(set(seen)) <= 97 and len(seen) == len(set(seen))   # no point computed twice
    assert gap == pytest.approx(float(got.sum()) - (f1 - f0), abs=1e-6)   # the error it says is its own
    assert abs(gap) <= 0.01 * max(1.0, abs(f1 - f0))
    torch.testing.assert_close(got, exact, rtol=0.02, atol=0.02)   # each token's share, not only the sum
    near = sum(1 for a in seen if abs(a - 0.71) < 0.0625)
    far = sum(1 for a in seen if abs(a - 0.55) < 0.0625)
    assert near >= 3 * far   # points went where f turns
    # Eight fixed Simpson panels (17 points) leave far more error on the same path.
    ev17, _, _ = _known_path(turns)
    _, _, _, gap17, n17 = adaptive_simpson(ev17, steps=17, batch=4, tolerance=0.01)
    assert n17 == 17 and abs(gap17) > 5 * abs(gap)


def test_the_adaptive_rule_stops_at_its_tolerance_or_its_budget():
    evaluate, _, _ = _known_path([(2.0, 0.5)])   # smooth: 17 points are enough
    assert adaptive_simpson(evaluate, steps=97, batch=8, tolerance=0.01)[4] == 17
    evaluate, _, _ = _known_path([(400.0, 0.3)])
    assert adaptive_simpson(evaluate, steps=25, batch=8, tolerance=1e-9)[4] <= 25
    with pytest.raises(ValueError, match="at least 3"):
        adaptive_simpson(evaluate, steps=2, batch=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def test_adaptive_integrated_gradients_meet_completeness_and_agree_with_many_fixed_nodes(tiny):
    t = len(IDS) - 1
    r = G.integrated_gradients(tiny, IDS, t, steps=97, positions=6, rule="adaptive", tolerance=0.01)
    assert r.moved == 6 and r.importances[:t - 6] == [0.0] * (t - 6) and r.steps <= 97
    assert r.gap == pytest.approx(sum(r.importances) - (r.log_prob - r.base_log_prob), abs=1e-5)
    assert abs(r.gap) <= 0.01 * max(1.0, abs(r.log_prob - r.base_log_prob))
    _, lp = G.gradient_importance(tiny, IDS, t)   # f(1) on the path is the token's log-prob
    assert r.log_prob == pytest.approx(lp, abs=1e-4)
    fixed = G.integrated_gradients(tiny, IDS, t, steps=64, positions=6, rule="gauss-legendre")
    torch.testing.assert_close(torch.tensor(r.importances), torch.tensor(fixed.importances), rtol=0.02, atol=0.005)
    with pytest.raises(ValueError, match="unknown rule"):
        G.integrated_gradients(tiny, IDS, t, rule="trapezoid")


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("gguf"), tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE,
                          embed_type="Q4_K")
    return load_model(path, device="cpu")


def test_quantized_matrices_are_widened_once_per_explain_not_once_per_pass(tiny_blocks, monkeypatch):
    model = tiny_blocks
    layers = quant_layers.quant_layers(model.decoder)
    calls = []
    real = quant_layers.QuantLinear.dequantized
    monkeypatch.setattr(quant_layers.QuantLinear, "dequantized", lambda self, dtype=torch.float32: (
        calls.append(self), real(self, dtype))[1])
    ids = [1, 40, 41, 42, 43, 44, 45, 46, 47]
    want = G.integrated_gradients(model, ids, 8, steps=9, positions=4, chunk=2)
    per_pass = len(calls)
    assert per_pass > 3 * len(layers)   # each batch widened every matrix again
    calls.clear()
    with quant_layers.widened_for_gradients(model.decoder) as nbytes:
        got = G.integrated_gradients(model, ids, 8, steps=9, positions=4, chunk=2)
    assert sorted(map(id, calls)) == sorted(map(id, layers))   # once each
    assert nbytes == G.widened_bytes(model) == sum(4 * m.in_features * m.out_features for m in layers)
    assert all(m._widened is None and not m.keep_widened for m in layers)   # dropped on exit
    assert got.importances == pytest.approx(want.importances, abs=1e-6) and math.isfinite(got.gap)
