"""Tests for runtime.generate.sampling: hand-computed cases, a statistical check, and property tests."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.generate.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    make_generator,
    min_p_filter,
    sample_next,
    top_k_filter,
    top_p_filter,
)

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()  # softmax(LOGITS) == PROBS


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logits)).flatten().tolist()


# --- parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"min_p": -0.1},
        {"min_p": 1.0},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"seed": "7"},
    ],
)
def test_invalid_params_raise_one_clear_sentence(kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert next(iter(kwargs)) in message and message.endswith(".")


def test_defaults_are_greedy_and_filters_off():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0


# --- each step, by hand -----------------------------------------------------------------


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen)
        assert sample_next(logits, SamplingParams()) == int(torch.argmax(logits))


def test_greedy_argmax_is_taken_after_the_repetition_penalty():
    logits = torch.tensor([5.0, 4.0, -1.0])
    params = SamplingParams(repetition_penalty=2.0)
    assert sample_next(logits, params) == 0
    assert sample_next(logits, params, previous_ids=[0]) == 1  # 5 / 2 = 2.5 < 4


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    before = logits.clone()
    out = apply_repetition_penalty(logits, [0, 1, 1, 0, 4], 2.0)  # repeats count once
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0]))
    torch.testing.assert_close(logits, before)  # pure: the input is untouched
    assert apply_repetition_penalty(logits, [], 2.0) is logits
    with pytest.raises(ValueError):
        apply_repetition_penalty(logits, [5], 2.0)


def test_temperature_divides():
    torch.testing.assert_close(apply_temperature(torch.tensor([1.0, -2.0]), 0.5), torch.tensor([2.0, -4.0]))
    with pytest.raises(ValueError):
        apply_temperature(torch.tensor([1.0]), 0.0)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([0.1, 3.0, -2.0, 2.0, 1.0])
    assert kept(top_k_filter(logits, 2)) == [1, 3]
    assert top_k_filter(logits, 0) is logits and top_k_filter(logits, 5) is logits


def test_top_k_keeps_every_token_tied_with_the_kth():
    assert kept(top_k_filter(torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0]), 2)) == [1, 2, 3, 4]


def test_top_k_sampling_only_returns_top_k_ids():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3))
    top = set(torch.topk(logits, 5).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=5, seed=11))
    drawn = {sampler(logits) for _ in range(500)}
    assert drawn <= top and len(drawn) == 5


@pytest.mark.parametrize(
    ("p", "expected"),
    # probs 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0. The smallest prefix with
    # mass >= p (p is kept off the exact sums, which float32 cannot promise to hit).
    [(0.01, [0]), (0.49, [0]), (0.51, [0, 1]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.97, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_set_with_mass_at_least_p(p, expected):
    shuffled = torch.tensor([2, 0, 3, 1])  # position i holds PROBS[shuffled[i]]
    logits = LOGITS[shuffled]
    assert sorted(shuffled[kept(top_p_filter(logits, p))].tolist()) == expected
    assert top_p_filter(logits, 1.0) is logits


@pytest.mark.parametrize(("min_p", "expected"), [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.35, [0, 1]), (0.9, [0])])
def test_min_p_keeps_tokens_with_p_at_least_min_p_times_p_max(min_p, expected):
    # thresholds min_p * 0.5 = 0.025, 0.1, 0.175, 0.45 against probs 0.5, 0.3, 0.15, 0.05
    assert kept(min_p_filter(LOGITS, min_p)) == expected
    assert min_p_filter(LOGITS, 0.0) is LOGITS


def test_temperature_sampling_matches_softmax_statistically():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    temperature = 0.7
    expected = torch.softmax(logits / temperature, dim=0)
    n = 20_000
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1234))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=5)
    freq = counts.double() / n
    # Each count is Binomial(n, p): standard error sqrt(p(1-p)/n) <= 0.0036 here. Five standard
    # errors fail a correct sampler with probability < 6e-7 per token (and the seed is fixed).
    tolerance = 5 * torch.sqrt(expected.double() * (1 - expected.double()) / n)
    assert torch.all((freq - expected.double()).abs() <= tolerance), (freq, expected)


# --- seeds, dtypes, bad input -----------------------------------------------------------


def draws(seed: int | None, n: int = 50) -> list[int]:
    logits = torch.zeros(1000)  # uniform: two different seeds agreeing 50 times is ~1e-150
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    return [sampler(logits) for _ in range(n)]


def test_same_seed_same_ids_different_seed_different_ids():
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_sampler_reset_replays_the_reply():
    logits = torch.zeros(1000)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    first = [sampler(logits) for _ in range(20)]
    sampler.reset()
    assert [sampler(logits) for _ in range(20)] == first


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(3, "cpu"), make_generator(3, torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype(dtype):
    logits = torch.tensor([0.0, 4.0, 1.0], dtype=dtype)
    assert sample_next(logits, SamplingParams()) == 1
    assert sample_next(logits, SamplingParams(temperature=1.0, top_k=1), generator=make_generator(0)) == 1


@pytest.mark.parametrize(
    "logits",
    [torch.tensor([0.0, math.nan]), torch.tensor([0.0, math.inf]), torch.full((3,), -math.inf), torch.zeros(2, 3)],
)
def test_bad_logits_raise(logits):
    with pytest.raises(ValueError):
        sample_next(logits, SamplingParams(temperature=1.0))


def test_only_one_token_left_gives_no_nan():
    logits = torch.tensor([-math.inf, 2.0, -math.inf, -math.inf])
    params = SamplingParams(temperature=0.3, top_k=2, top_p=0.1, min_p=0.5)
    assert sample_next(logits, params, generator=make_generator(0)) == 1


# --- properties -------------------------------------------------------------------------

finite = st.floats(min_value=-50, max_value=50, allow_nan=False, width=32)
logit_lists = st.lists(st.one_of(finite, finite, finite, st.just(-math.inf)), min_size=1, max_size=64).filter(
    lambda xs: any(math.isfinite(x) for x in xs)
)
param_sets = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=5.0)),
    top_k=st.integers(min_value=0, max_value=70),
    top_p=st.floats(min_value=1e-6, max_value=1.0),
    min_p=st.floats(min_value=0.0, max_value=0.99),
    repetition_penalty=st.floats(min_value=0.5, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**32),
)


@settings(max_examples=200, deadline=None)
@given(values=logit_lists, params=param_sets, data=st.data())
def test_sample_next_returns_an_id_that_survives_every_filter(values, params, data):
    logits = torch.tensor(values)
    previous = data.draw(st.lists(st.integers(0, len(values) - 1), max_size=8))
    token = sample_next(logits, params, generator=make_generator(params.seed), previous_ids=previous)
    assert 0 <= token < len(values)
    x = apply_repetition_penalty(logits, previous, params.repetition_penalty)
    if params.greedy:
        assert token == int(torch.argmax(x))
        return
    x = apply_temperature(x, params.temperature)
    for step in (lambda t: top_k_filter(t, params.top_k), lambda t: top_p_filter(t, params.top_p),
                 lambda t: min_p_filter(t, params.min_p)):
        x = step(x)
        assert math.isfinite(float(x[token]))


@settings(max_examples=200, deadline=None)
@given(values=logit_lists, k=st.integers(0, 70), p=st.floats(1e-6, 1.0), min_p=st.floats(0.0, 0.99))
def test_filters_never_nan_and_always_keep_the_argmax(values, k, p, min_p):
    logits = torch.tensor(values)
    best = int(torch.argmax(logits))
    top_k = top_k_filter(logits, k)
    for out in (top_k, top_p_filter(logits, p), min_p_filter(logits, min_p),
                min_p_filter(top_p_filter(top_k, p), min_p)):
        assert not torch.isnan(out).any()
        assert out[best] == logits[best]
        assert not torch.isnan(torch.softmax(out, dim=0)).any()
    # top-k keeps at least min(k, finite) tokens, and every kept logit >= every removed one
    survivors = torch.isfinite(top_k)
    if 0 < k:
        assert int(survivors.sum()) >= min(k, int(torch.isfinite(logits).sum()))
    if (~survivors).any() and survivors.any():
        assert logits[survivors].min() >= logits[~survivors].max()
