"""Attention: the worked example, and the fast path agreeing with the reference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.attention import (
    attention,
    attention_fast,
    attention_reference,
    causal_mask,
)

# "Attention in transformers explained with numbers": the, cat, sat.
KEYS = torch.tensor([[0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])[None, None]  # (1, 1, 3, 2)
VALUES = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, None]


def test_worked_example_scaled():
    q = torch.tensor([[2.0, 0.0]])[None, None]
    out, w = attention(q, KEYS, VALUES, causal=False, return_weights=True)
    torch.testing.assert_close(w[0, 0, 0], torch.tensor([0.045, 0.768, 0.187]), atol=1e-3, rtol=0)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([0.232, 0.955]), atol=1e-3, rtol=0)
    # The fast path gives the same output.
    torch.testing.assert_close(attention(q, KEYS, VALUES, causal=False), out)


def test_worked_example_unscaled():
    q = torch.tensor([[2.0, 0.0]])[None, None]
    _, w = attention(q, KEYS, VALUES, causal=False, scale=1.0, return_weights=True)
    torch.testing.assert_close(w[0, 0, 0], torch.tensor([0.016, 0.867, 0.117]), atol=1e-3, rtol=0)


def test_worked_example_causal():
    # Queries for all three tokens; "cat" (row 1) has query (0, 1).
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])[None, None]
    out, w = attention(q, KEYS, VALUES, causal=True, return_weights=True)
    torch.testing.assert_close(w[0, 0, 1], torch.tensor([0.670, 0.330, 0.0]), atol=1e-3, rtol=0)
    assert w[0, 0, 0, 1:].abs().max() == 0  # "the" sees only itself
    torch.testing.assert_close(attention(q, KEYS, VALUES, causal=True), out)


def test_causal_block_is_aligned_to_the_end_of_the_keys():
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_default_scale_is_one_over_sqrt_d():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    _, w = attention(q, k, v, causal=False, return_weights=True)
    _, w2 = attention(q, k, v, causal=False, scale=1 / math.sqrt(8), return_weights=True)
    torch.testing.assert_close(w, w2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    torch.testing.assert_close(w, torch.softmax(scores, -1))


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 4),
    tq=st.integers(1, 9),
    extra=st.integers(0, 9),
    d=st.sampled_from([4, 8, 16]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fast_path_agrees_with_reference(b, hkv, groups, tq, extra, d, causal, seed):
    g = torch.Generator().manual_seed(seed)
    h, tk = hkv * groups, tq + extra
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    ref, w = attention_reference(q, k, v, causal=causal)
    fast = attention_fast(q, k, v, causal=causal)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.sum(-1), torch.ones(b, h, tq))


@pytest.mark.parametrize("tq,tk", [(1, 1), (1, 7), (6, 6), (3, 10)])
def test_grouped_query_equals_repeated_heads(tq, tk):
    """GQA = multi-head attention with each KV head repeated for its query heads."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, tq, 16), torch.randn(2, 2, tk, 16), torch.randn(2, 2, tk, 16)
    expected = attention_fast(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(attention(q, k, v), expected, atol=1e-5, rtol=1e-4)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention(torch.randn(1, 5, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="4-D"):
        attention(torch.randn(5, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))


# ---- sliding window (Mistral, Gemma) and soft-capping (Gemma 2) ---------------------------
def test_window_mask_is_a_band_aligned_to_the_end_of_the_keys():
    # 2 new queries after 3 cached keys, window 2: each sees itself and the key before it.
    assert causal_mask(2, 5, window=2).tolist() == [
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]
    assert torch.equal(causal_mask(4, 4, window=99), causal_mask(4, 4))


@pytest.mark.parametrize("tq,tk,window", [(1, 9, 3), (1, 3, 3), (4, 4, 2), (3, 10, 4), (5, 12, 1), (6, 6, 6), (2, 7, 20)])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (4, 1)])
def test_window_fast_path_agrees_with_the_reference(tq, tk, window, h, hkv):
    g = torch.Generator().manual_seed(tq * 100 + tk * 10 + window)
    q = torch.randn(1, h, tq, 8, generator=g)
    k, v = torch.randn(1, hkv, tk, 8, generator=g), torch.randn(1, hkv, tk, 8, generator=g)
    ref, w = attention_reference(q, k, v, window=window)
    torch.testing.assert_close(attention_fast(q, k, v, window=window), ref, atol=1e-5, rtol=1e-5)
    # The weights follow the formula: query i (key index tk - tq + i) weighs only its window.
    for i in range(tq):
        pos = tk - tq + i
        seen = (w[0, :, i] > 0).any(0).nonzero().flatten().tolist()
        assert seen == list(range(max(0, pos - window + 1), pos + 1))


def test_softcap_bounds_the_scores_and_both_paths_agree():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 5, 8, generator=g) * 10, torch.randn(1, 1, 5, 8, generator=g) * 10, torch.randn(1, 1, 5, 8, generator=g)
    out, w = attention_reference(q, k, v, softcap=1.0, window=3)
    torch.testing.assert_close(attention(q, k, v, softcap=1.0, window=3), out)
    # Scores within +-1 after the cap: no weight can exceed e^2 times another in the same row.
    row = w[0, 0, 4, 2:]
    assert row.max() / row.min() <= math.e ** 2 + 1e-4
    assert not torch.allclose(out, attention(q, k, v, window=3))
