"""Jain and Wallace's tests (runtime.insight.explain) and head ablation (runtime.insight.ablation) on a tiny
seeded llama: Kendall's tau on hand-checked cases, gradients and integrated gradients
against a direct autograd computation, the permutation counterfactual against a
forward with the attention replaced by hand, the ablation hook off and on."""
from __future__ import annotations

import math

import pytest
import torch

import runtime.model.attention as model_mod  # the module the Attention layer finds attention() in
from runtime import load_model
from runtime.insight.ablation import (
    HeadAblation,
    ablated,
    copy_losses,
    induction_ablation,
    parse_heads,
    top_and_probs,
)
from runtime.insight.explain import (
    baseline_token,
    explain_token,
    gradient_importance,
    kendall_tau,
    permutation_test,
)
from runtime.insight.probe import HeadScores, repeated_random_tokens
from runtime.model.attention import attention_reference

#: No token twice: the gradient on an embedding row is then one context token's gradient.
IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


@pytest.mark.parametrize("a, b, tau", [
    ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
    ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
    ([1, 2, 3], [1, 3, 2], 1 / 3),                  # 2 concordant pairs, 1 discordant
    ([1, 1, 2], [1, 2, 3], 2 / math.sqrt(2 * 3)),   # tau-b: one pair tied in a
])
def test_kendall_tau_hand_checked(a, b, tau):
    assert kendall_tau(a, b) == pytest.approx(tau)


def test_kendall_tau_constant_and_bad_lengths():
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        kendall_tau([1, 2], [1, 2, 3])


def _embedding_grads(model, ctx: list[int], token: int, alpha: float = 1.0, base: torch.Tensor | None = None):
    """d log p(token) / d x_j at the embeddings ``base + alpha (x - base)``, through the embedding
    matrix's gradient (the tiny llama's embeddings are not tied to its head, no token repeats)."""
    emb = model.decoder.embed
    saved = emb.weight
    base = torch.zeros(saved.shape[1]) if base is None else base  # (C,) or (V, C)
    emb.weight = torch.nn.Parameter(base + alpha * (saved.detach() - base))
    try:
        with torch.enable_grad():
            lp = torch.log_softmax(model.decoder(torch.tensor([ctx]))[0, -1], -1)[token]
            lp.backward()
        return emb.weight.grad[ctx].clone()  # (t, C)
    finally:
        emb.weight = saved


def test_input_x_gradient_equals_a_direct_autograd_computation(tiny):
    t = 8
    got, lp = gradient_importance(tiny, IDS, t)
    g = _embedding_grads(tiny, IDS[:t], IDS[t])
    x = tiny.decoder.embed.weight[IDS[:t]].detach()
    torch.testing.assert_close(torch.tensor(got), (x * g).sum(-1), rtol=1e-4, atol=1e-6)
    with torch.inference_mode():
        want = torch.log_softmax(tiny.logits(IDS[:t])[0, -1], -1)[IDS[t]]
    assert lp == pytest.approx(float(want), abs=1e-5)


def test_integrated_gradients_two_steps_by_hand_and_completeness(tiny):
    t = 6
    x = tiny.decoder.embed.weight[IDS[:t]].detach()
    W = tiny.decoder.embed.weight.detach()
    assert baseline_token(tiny) == tiny.tokenizer.pad_token_id
    # The baseline: the padding token's embedding everywhere but the first token, which stays.
    B = W[baseline_token(tiny)].expand_as(W).clone()
    B[IDS[0]] = W[IDS[0]]
    # Two midpoint steps: alpha = 1/4 and 3/4.
    g = (_embedding_grads(tiny, IDS[:t], IDS[t], 0.25, B) + _embedding_grads(tiny, IDS[:t], IDS[t], 0.75, B)) / 2
    got, _ = gradient_importance(tiny, IDS, t, method="integrated_gradients", steps=2, rule="midpoint")
    torch.testing.assert_close(torch.tensor(got), ((x - B[IDS[:t]]) * g).sum(-1), rtol=1e-4, atol=1e-6)
    assert got[0] == 0.0
    # Completeness (Sundararajan et al. 2017): the sum approaches logp(x) - logp(0).
    ex = explain_token(tiny, IDS, t, layer=1, head=2, ig_steps=16, permutations=4)
    assert abs(ex.ig_gap) < 0.01 * abs(sum(ex.integrated_gradients))  # 16 steps: 0.1 % here
    assert len(ex.attention) == len(ex.integrated_gradients) == t
    assert sum(ex.attention) == pytest.approx(1.0, abs=1e-5)
    k = ex.ig_positions   # the tokens integrated gradients moved (all but the first here)
    assert k == t - 1 and ex.tau_integrated_gradients == pytest.approx(
        kendall_tau(ex.attention[-k:], [abs(v) for v in ex.integrated_gradients[-k:]]))
    assert ex.sentence.endswith(".") and "tau" in ex.sentence


def test_permutation_equals_attention_replaced_by_hand(tiny, monkeypatch):
    t, layer, head, n, seed = 9, 1, 3, 3, 7
    res = permutation_test(tiny, IDS, t, layer, head, n=n, seed=seed)
    ctx = IDS[:t]
    with torch.inference_mode():
        p0 = torch.softmax(tiny.logits(ctx)[0, -1], -1)
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(t, generator=g) for _ in range(n)]
    real = model_mod.attention
    tvs, changed = [], 0
    for perm in perms:
        calls = []

        def by_hand(q, k, v, causal=True, perm=perm, calls=calls, **_kernels):
            calls.append(1)
            out, w = attention_reference(q, k, v, causal=causal)  # (1, H, t, D), (1, H, t, t)
            if len(calls) - 1 == layer:  # layers run in order
                kv = head // (q.shape[1] // k.shape[1])
                out = out.clone()
                out[0, head, -1] = w[0, head, -1][perm] @ v[0, kv]
            return out

        monkeypatch.setattr(model_mod, "attention", by_hand)
        with torch.inference_mode():
            p = torch.softmax(tiny.logits(ctx)[0, -1], -1)
        monkeypatch.setattr(model_mod, "attention", real)
        tvs.append(float(0.5 * (p - p0).abs().sum()))
        changed += int(p.argmax() != p0.argmax())
    assert res.tv == pytest.approx(tvs, abs=1e-5)
    assert res.median_tv == pytest.approx(sorted(tvs)[1], abs=1e-5)
    assert res.top_changed == changed / n
    assert any(v > 1e-4 for v in res.tv)  # the tiny model's attention is not uniform: permuting moves it


def test_explain_rejects_bad_input(tiny):
    with pytest.raises(ValueError, match="outside 1"):
        gradient_importance(tiny, IDS, 0)
    with pytest.raises(ValueError, match="head"):
        permutation_test(tiny, IDS, 5, 0, 9)
    with pytest.raises(ValueError, match="layer"):
        permutation_test(tiny, IDS, 5, 2, 0)


def _o_proj_inputs(model, ids) -> list[torch.Tensor]:
    """Each layer's heads' outputs ``(T, H, D)`` as o_proj receives them."""
    got = []
    hooks = [b.attn.o_proj.register_forward_pre_hook(lambda m, a: got.append(a[0][0].clone()))
             for b in model.decoder.blocks]
    try:
        with torch.inference_mode():
            logits = model.logits(ids)
    finally:
        for h in hooks:
            h.remove()
    H = model.config.n_heads
    return [y.view(y.shape[0], H, -1) for y in got], logits


def test_ablation_off_is_bit_identical(tiny):
    with torch.inference_mode():
        before = tiny.logits(IDS)
    with ablated(tiny, []):
        with torch.inference_mode():
            empty = tiny.logits(IDS)
    with ablated(tiny, [(0, 1)]):
        pass
    assert all(b.attn.head_edit is None for b in tiny.decoder.blocks)
    with torch.inference_mode():
        after = tiny.logits(IDS)
    assert torch.equal(before, after) and torch.equal(before, empty)


def test_ablation_zeroes_exactly_the_chosen_heads(tiny):
    base, base_logits = _o_proj_inputs(tiny, IDS)
    with ablated(tiny, [(1, 0), (1, 3)], "zero"):
        ys, logits = _o_proj_inputs(tiny, IDS)
    assert torch.equal(ys[0], base[0])                       # layer 0 untouched
    assert torch.count_nonzero(ys[1][:, [0, 3]]) == 0        # the chosen heads are zero
    assert torch.equal(ys[1][:, [1, 2]], base[1][:, [1, 2]])  # the others pass through
    assert not torch.equal(logits, base_logits)
    with ablated(tiny, [(0, 2)], "mean"):
        ys, _ = _o_proj_inputs(tiny, IDS)
    mean = base[0][:, 2].mean(0)  # (D,): over the positions of the one sequence
    torch.testing.assert_close(ys[0][:, 2], mean.expand_as(ys[0][:, 2]))
    assert torch.equal(ys[0][:, [0, 1, 3]], base[0][:, [0, 1, 3]])


def test_ablation_bad_input(tiny):
    with pytest.raises(ValueError, match="outside"):
        with ablated(tiny, [(2, 0)]):
            pass
    with pytest.raises(ValueError, match="mode"):
        HeadAblation([(0, 0)], "half")
    assert parse_heads("3.1, L5.H0") == [(3, 1), (5, 0)]
    with pytest.raises(ValueError, match="layer.head"):
        parse_heads("3")


def test_knock_out_changes_the_token_probability(tiny):
    before = top_and_probs(tiny, IDS, 8)
    with ablated(tiny, [(0, h) for h in range(4)] + [(1, h) for h in range(4)], "zero"):
        after = top_and_probs(tiny, IDS, 8)
    assert len(before["top"]) == 5 and before["top"][0][1] >= before["top"][-1][1]
    assert before["prob"] != pytest.approx(after["prob"])


def test_induction_preset_mechanics(tiny):
    """Planted scores choose the heads; losses are the mean cross-entropies of each copy."""
    scores = HeadScores(induction=[[0.0, 0.9, 0.0, 0.0], [0.8, 0.0, 0.0, 0.0]], previous_token=[[0.0] * 4] * 2)
    r = induction_ablation(tiny, scores=scores, n_heads=2, repeat_len=8, batch=2, seed=3, controls=2, mode="zero")
    assert r.heads == [(0, 1), (1, 0)]
    assert all(len(h) == 2 and not set(h) & {(0, 1), (1, 0)} for h in r.random_heads)
    ids = repeated_random_tokens(tiny, 8, 2, 3)
    assert (r.baseline_first, r.baseline_second) == pytest.approx(copy_losses(tiny, ids, 8))
    with ablated(tiny, r.heads, "zero"):
        assert r.induction_second == pytest.approx(copy_losses(tiny, ids, 8)[1])
    with pytest.raises(ValueError, match="n_heads"):
        induction_ablation(tiny, scores=scores, n_heads=5)


def test_layer_mean_permutes_every_head_alike(tiny):
    """With the layer mean every head's row is permuted (by the same permutations, same seed):
    the distribution moves more than when any one head is permuted alone."""
    all_heads = permutation_test(tiny, IDS, 9, 1, "mean", n=4, seed=1)
    one = [permutation_test(tiny, IDS, 9, 1, h, n=4, seed=1).median_tv for h in range(4)]
    assert all_heads.n == 4 and all_heads.median_tv > max(one)
    with pytest.raises(ValueError, match="head"):
        explain_token(tiny, IDS, 9, layer=1, head="max")
