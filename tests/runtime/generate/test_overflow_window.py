"""The overflow policies on a sliding-window cache, across the window edge, against a fresh prefill.

A tiny seeded Gemma-3-like model (multi-query, q/k norms, local and global RoPE bases):
layers sliding (window 8), full, sliding, so the last layer, whose attention reaches the
logits last, is a sliding one. A chat session runs at a 48-token context (six windows)
with a cache whose sliding layers really drop old tokens (4-token chunks) and with the
default cache (whose buffers keep them). At every sampling step a logits processor
records the row the session samples from and the tokens its cache holds; the oracle is
a fresh prefill of exactly those tokens, no cache (:meth:`Model.logits`).

- ``stop`` and ``truncate-middle`` rebuild what they keep: every row equals the fresh one.
- ``rolling`` keeps keys computed while the evicted tokens were still there (that is
  StreamingLLM), so a fresh prefill of the kept tokens differs past layer 0. On a
  *context-free* copy of the model (every attention but the last layer's outputs zero:
  each layer's keys and values then depend on the token and its position only) the
  eviction, the re-rotation of the kept keys and the sliding layers' offsets must give
  exactly the fresh prefill's cache and logits, at every step.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime import ChatSession, GenerationSettings, SamplingParams, load_model
from runtime.cache.kv_cache import KVCache
from tests.runtime.session_helpers import run_turn
from tests.runtime.tiny_models import WINDOW, make_tiny_model

CONTEXT = 6 * WINDOW
SINKS = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
FIRST = "the cat"  # 20 tokens with the template
SECOND = "who are you"  # 21


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overflow-window"), "gemma3", overrides={"layer_types": LAYER_TYPES})


@pytest.fixture(scope="module")
def model(folder):
    m = load_model(folder, device="cpu", dtype="float32")
    assert m.config.windows == (WINDOW, None, WINDOW) and m.config.n_kv_heads == 1 and m.config.qk_norm
    return m


@pytest.fixture(scope="module")
def context_free(folder):
    """The same model with the attention outputs of every layer but the last set to zero."""
    m = load_model(folder, device="cpu", dtype="float32")
    with torch.no_grad():
        for block in m.decoder.blocks[:-1]:
            block.attn.o_proj.weight.zero_()
    return m


class Recorder:
    """A logits processor: at each sampling step, the row and the tokens the cache holds."""

    def __init__(self):
        self.session: ChatSession | None = None
        self.steps: list[tuple[list[int], torch.Tensor]] = []
        self.starts: set[int] = set()  # offsets the sliding layers had

    def __call__(self, generated, row):
        cache = self.session.cache
        self.steps.append((self.session.cached_token_ids, row.clone()))
        self.starts.update(cache.start[i] for i, w in enumerate(cache.windows) if w is not None)
        return row


def _session(model, policy: str, chunk_tokens: int, max_new_tokens: int) -> tuple[ChatSession, Recorder]:
    rec = Recorder()
    settings = GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=max_new_tokens,
                                  context_limit=CONTEXT, overflow=policy, sink_tokens=SINKS, prefill_chunk=5,
                                  logits_processors=(rec,))
    s = ChatSession(model, settings=settings)
    c = model.config
    s.cache = KVCache(c.n_layers, c.n_kv_heads, c.head_dim, CONTEXT, chunk_tokens=chunk_tokens, windows=c.windows)
    rec.session = s
    return s, rec


def _fresh(model, ids: list[int]) -> torch.Tensor:
    """The last row of a fresh prefill of ``ids`` (no cache)."""
    with torch.inference_mode():
        return model.logits(ids)[0, -1]


def _assert_steps_equal_fresh(model, rec: Recorder) -> None:
    for i, (ids, row) in enumerate(rec.steps):
        assert len(ids) <= CONTEXT
        torch.testing.assert_close(row, _fresh(model, ids), atol=1e-4, rtol=1e-4, msg=lambda m: f"step {i}: {m}")


def _shrank(turn) -> bool:
    return any(b < a for a, b in zip(turn.cache_lengths, turn.cache_lengths[1:]))


#: 4-token chunks: the sliding layers drop what left their window; 256: the buffers keep it (masked).
CHUNKS = pytest.mark.parametrize("chunk_tokens", [4, 256], ids=["dropping-cache", "default-cache"])


@CHUNKS
def test_stop_fills_the_context_and_every_step_equals_a_fresh_prefill(model, chunk_tokens):
    s, rec = _session(model, "stop", chunk_tokens, max_new_tokens=40)
    t = run_turn(s, s.send(FIRST))
    assert t.finish.reason == "context" and s.cache.length == CONTEXT
    assert len(rec.steps) > WINDOW  # the reply alone crosses the window edge
    _assert_steps_equal_fresh(model, rec)
    if chunk_tokens < WINDOW:
        assert max(rec.starts) > 0  # the sliding layers dropped tokens on the way


@CHUNKS
def test_truncate_middle_drops_turns_and_every_step_equals_a_fresh_prefill(model, chunk_tokens):
    s, rec = _session(model, "truncate-middle", chunk_tokens, max_new_tokens=16)
    t1 = run_turn(s, s.send(FIRST))
    assert t1.finish.reason == "length"
    t2 = run_turn(s, s.send(SECOND))  # the first turn is dropped, before or while the reply runs
    assert t2.finish.reason == "length" and t2.stats.dropped_tokens > 0
    assert max(t1.cache_lengths + t2.cache_lengths) <= CONTEXT
    _assert_steps_equal_fresh(model, rec)
    if chunk_tokens < WINDOW:
        assert max(rec.starts) > 0


@CHUNKS
def test_rolling_evicts_across_the_window_and_equals_a_fresh_prefill(context_free, chunk_tokens):
    m = context_free
    s, rec = _session(m, "rolling", chunk_tokens, max_new_tokens=40)
    t1 = run_turn(s, s.send(FIRST))  # the reply outgrows the context: evictions while decoding
    assert t1.finish.reason == "length" and _shrank(t1)
    s.settings = replace(s.settings, max_new_tokens=6)
    t2 = run_turn(s, s.send(SECOND))  # a prompt longer than the context: evictions while prefilling
    assert t2.stats.prompt_tokens > CONTEXT and t2.stats.completion_tokens == 6
    assert max(t1.cache_lengths + t2.cache_lengths) <= CONTEXT
    assert s.cached_token_ids[:SINKS] == rec.steps[0][0][:SINKS]  # the sinks stay
    _assert_steps_equal_fresh(m, rec)
    if chunk_tokens < WINDOW:
        assert max(rec.starts) > 0
    # The cache itself, layer by layer: the slots each layer holds equal a fresh prefill's
    # keys and values at the same positions (re-rotated keys included).
    ids = s.cached_token_ids
    fresh = m.new_cache(CONTEXT)
    with torch.inference_mode():
        m.logits(ids, fresh)
    n = s.cache.length
    assert n == len(ids)
    for i in range(m.config.n_layers):
        a = s.cache.start[i]
        held = n - a
        assert held >= min(n, m.config.windows[i] or n)
        torch.testing.assert_close(s.cache.k[i][:, :, :held], fresh.k[i][:, :, a:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.cache.v[i][:, :, :held], fresh.v[i][:, :, a:n], atol=1e-5, rtol=1e-5)


def test_rolling_on_the_whole_model_differs_from_a_fresh_prefill_only_after_an_eviction(model):
    """Why the rolling test uses the context-free copy: with every attention on, the steps
    before the first eviction equal a fresh prefill, the ones after do not."""
    s, rec = _session(model, "rolling", 4, max_new_tokens=40)
    t = run_turn(s, s.send(FIRST))
    assert _shrank(t)
    diffs = [(row - _fresh(model, ids)).abs().max().item() for ids, row in rec.steps]
    first_evicted = next(i for i in range(1, len(rec.steps)) if len(rec.steps[i][0]) < len(rec.steps[i - 1][0]))
    assert max(diffs[:first_evicted]) < 1e-4
    assert max(diffs[first_evicted:]) > 1e-3
