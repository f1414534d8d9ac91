"""The attention view's runtime side on tiny seeded models: the live capture (last query row,
with a KV cache), one layer's matrix and the formula's numbers, a planted previous-token head."""
from __future__ import annotations

import math

import pytest
import torch

from runtime import (
    ChatSession,
    GenerationSettings,
    LayerAttention,
    context_ids,
    conversation_ids,
    load_model,
    token_strings,
)
from runtime.generate.chat_format import Message
from runtime.generate.sampling import SamplingParams
from runtime.insight.probe import AttentionCapture, head_scores
from runtime.model.attention import attention


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


def test_live_capture_keeps_the_newest_row_and_equals_attention_on_the_same_inputs(tiny):
    """Decode one token after a cached prefill: the captured row is attention() on that token's q."""
    L, H = tiny.config.n_layers, tiny.config.n_heads
    cache = tiny.new_cache(64)
    with AttentionCapture(tiny, last_row_only=True) as cap:
        tiny.logits(IDS[:-1], cache)                # a prefill chunk: one row kept per layer
        assert all(cap.weights[i].shape == (1, H, len(IDS) - 1) for i in range(L))
        v0 = cap.version
        tiny.logits(IDS[-1:], cache)                # the decode step, through the cache
        assert cap.version == v0 + L
    assert tiny.decoder.observer is None
    for layer in range(L):
        la = LayerAttention(tiny, IDS, layer)
        q, k, v = la.q, la.k, la.v
        _, w = attention(q[:, :, -1:], k, v, return_weights=True)  # (1, H, 1, T)
        assert cap.weights[layer].shape == (1, H, len(IDS))
        torch.testing.assert_close(cap.weights[layer], w[:, :, 0], rtol=1e-5, atol=1e-6)


def test_layer_matrix_equals_the_full_capture_and_the_formula_adds_up(tiny):
    with AttentionCapture(tiny) as cap:
        tiny.logits(IDS)
    T = len(IDS)
    for layer in range(tiny.config.n_layers):
        la = LayerAttention(tiny, IDS, layer)
        full = cap.weights[layer][0]  # (H, T, T)
        for h in range(tiny.config.n_heads):
            m = la.matrix(h)
            assert m.shape == (T, T) and m.dtype == torch.float32
            torch.testing.assert_close(m, full[h])
            assert torch.all(torch.triu(m, diagonal=1) == 0)  # the causal upper triangle
        torch.testing.assert_close(la.matrix("mean"), full.mean(0))
        torch.testing.assert_close(la.matrix("max"), full.max(0).values)
        steps = la.explain(1, 7, top=3)
        assert steps.query == 7 and steps.n_keys == 8 and len(steps.keys) == 3
        assert steps.head_dim == tiny.config.head_dim and steps.scale == pytest.approx(1 / math.sqrt(steps.head_dim))
        torch.testing.assert_close(torch.tensor(steps.weights), full[1, 7, steps.keys])
        assert steps.weights == sorted(steps.weights, reverse=True)
        for raw, scaled, e, w in zip(steps.raw, steps.scaled, steps.exp, steps.weights):
            assert scaled == pytest.approx(raw * steps.scale, rel=1e-5)
            assert e == pytest.approx(math.exp(scaled - steps.max_scaled), rel=1e-5)
            assert w == pytest.approx(e / steps.denominator, rel=1e-5)
        # |o| is the norm of this head's attention output for the query.
        kv = steps.kv_head
        o = full[1, 7, :8] @ la.v[0, kv, :8].float()
        assert steps.output_norm == pytest.approx(float(o.norm()), rel=1e-4)
        assert la.explain(1, -1).query == T - 1
    with pytest.raises(ValueError):
        LayerAttention(tiny, IDS, tiny.config.n_layers)
    with pytest.raises(ValueError):
        la.matrix(tiny.config.n_heads)
    with pytest.raises(ValueError):
        la.explain(0, T)


def test_context_ids_are_what_the_cache_holds(tiny):
    s = ChatSession(tiny, settings=GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=6,
                                                      context_limit=128))
    fin = s.run(s.send("the cat"))
    ids = context_ids(s)
    assert len(ids) == s.cache.length > 0
    prompt = conversation_ids(tiny, [Message("user", "the cat")])
    assert ids[: len(prompt)] == prompt and fin.stats.prompt_tokens == len(prompt)
    texts = token_strings(tiny, ids, cache := {})
    assert len(texts) == len(ids) and "<|im_start|>" in texts and set(cache) == set(ids)
    # A conversation that ends with the reply gets no generation prompt.
    both = conversation_ids(tiny, s.messages)
    assert both[: len(prompt)] == prompt and len(both) > len(prompt)


def test_head_scores_find_a_planted_previous_token_head(tmp_path_factory):
    """Qwen2 has q/k biases: zero head 0's q/k weights and set the biases so that, after RoPE,
    the query-key score peaks one position back (score(i, j) = c^2 sum_f cos(f (j - i + 1)))."""
    from tests.runtime.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path_factory.mktemp("planted"), "qwen2"), device="cpu", dtype="float32")
    cfg = model.config
    H, D = cfg.n_heads, cfg.head_dim
    attn = model.decoder.blocks[0].attn
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # (D/2,)
    c, pairs = 12.0, 4
    q_bias, k_bias = torch.zeros(D), torch.zeros(D)
    for i in range(pairs):  # rotary pair i is dims (i, i + D/2)
        q_bias[i] = c
        k_bias[i], k_bias[i + D // 2] = c * math.cos(inv_freq[i]), c * math.sin(inv_freq[i])
    with torch.no_grad():
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        w[0:D].zero_()
        b[0:D] = q_bias               # query head 0
        w[H * D : H * D + D].zero_()
        b[H * D : H * D + D] = k_bias  # KV head 0 (read by query heads 0 .. G-1)
    s = head_scores(model, repeat_len=20, batch=2)
    assert s.previous_token[0][0] > 0.95
    assert s.top("previous_token", 1)[0][:2] == (0, 0)
    assert s.induction[0][0] < 0.1
    assert model.decoder.observer is None
