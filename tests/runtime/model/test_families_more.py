"""Llama 3.x, Qwen3, Gemma 2/3, Phi-3, windowed Mistral/Qwen2, Granite, OLMo 2 and SmolLM3 against
transformers' own models.

Each family is a tiny seeded random model from transformers' config class
(``tests/runtime/tiny_models.py``, :data:`MORE_FAMILIES`): the prefill, a cached decode
that crosses the sliding window's edge (with a cache whose sliding layers really drop
old tokens), and a decode after a crop give transformers' logits.
"""
from __future__ import annotations

import pytest
import torch

from runtime import UnsupportedModelError, load_model
from runtime.cache.kv_cache import KVCache
from runtime.config.model import ModelConfig
from tests.runtime.tiny_models import MORE_FAMILIES, VOCAB_SIZE, WINDOW, make_tiny_model

SEQ_LEN = 24
PREFILL = 10
#: Small chunks so the sliding layers drop tokens (and move the rest) several times in 24.
CHUNK = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-more")
    return {family: make_tiny_model(root, family) for family in MORE_FAMILIES}


@pytest.fixture(scope="module")
def models(folders):
    return {family: load_model(folders[family], device="cpu", dtype="float32") for family in MORE_FAMILIES}


def _ids(n: int = SEQ_LEN, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (1, n), generator=torch.Generator().manual_seed(seed))


_refs: dict = {}


def _theirs(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    if folder not in _refs:
        _refs[folder] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return _refs[folder](ids).logits.float()


def _small_chunk_cache(m, max_tokens: int = 64) -> KVCache:
    c = m.config
    return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, chunk_tokens=CHUNK, windows=c.windows)


#: What each family's config must say (the piece under test is really switched on).
EXPECTED = {
    "llama3": dict(rope_type="llama3", windows=(None, None)),
    "qwen3": dict(qk_norm=True, windows=(None, None)),
    "gemma2": dict(attn_softcap=2.0, final_softcap=3.0, norm_offset=1.0, sandwich_norms=True, windows=(WINDOW, None)),
    "gemma3": dict(qk_norm=True, n_kv_heads=1, norm_offset=1.0, windows=(WINDOW, WINDOW, None), rope_type="linear"),
    "phi3": dict(rope_type="longrope", windows=(2 * WINDOW, 2 * WINDOW)),
    "mistral-window": dict(windows=(WINDOW, WINDOW)),
    "qwen2-window": dict(windows=(None, WINDOW)),
    "granite": dict(windows=(None, None), embed_scale=12.0, attn_scale=0.015625, residual_scale=0.22, logits_scaling=8.0),
    "olmo2": dict(windows=(None, None), qk_norm=True, qk_norm_whole=True, pre_norms=False, sandwich_norms=True),
    "smollm3": dict(windows=(None,) * 4, nope_layers=(3,)),
}


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_prefill_logits_match_transformers(folders, models, family):
    m = models[family]
    c = m.config
    want = EXPECTED[family]
    assert c.windows == want["windows"]
    for name in ("qk_norm", "n_kv_heads", "attn_softcap", "final_softcap", "norm_offset", "sandwich_norms", "embed_scale",
                 "attn_scale", "residual_scale", "logits_scaling", "qk_norm_whole", "pre_norms", "nope_layers"):
        if name in want:
            assert getattr(c, name) == want[name], name
    if "rope_type" in want:
        assert c.rope.type == want["rope_type"]
    if family == "gemma3":  # local and global layers rotate with their own bases
        assert (c.layer_rope(0).theta, c.layer_rope(2).theta) == (10000.0, 1000000.0)
    ids = _ids()
    ours, theirs = m.logits(ids), _theirs(folders[family], ids)
    assert theirs.abs().max() * c.logits_scaling > 0.5  # O(1) logits (Granite's before its division): 1e-4 is a real check
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_cached_decode_across_the_window_edge(folders, models, family):
    m = models[family]
    ids = _ids()
    full = _theirs(folders[family], ids)
    cache = _small_chunk_cache(m)
    steps = [m.logits(ids[:, :PREFILL], cache)]
    for t in range(PREFILL, SEQ_LEN):
        steps.append(m.logits(ids[:, t : t + 1], cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    for i, w in enumerate(m.config.windows):
        if w is None:
            assert cache.start[i] == 0 and cache.k[i].shape[2] >= SEQ_LEN
        else:  # a bounded buffer: the window and one chunk at most, old tokens dropped
            assert cache.start[i] > 0 and cache.k[i].shape[2] <= w + CHUNK
            assert cache.layer_tokens(i) == w


@pytest.mark.parametrize("family", ["gemma3", "mistral-window", "gemma2"])
def test_decode_after_a_crop(folders, models, family):
    m = models[family]
    ids = _ids()
    other = _ids(seed=99)
    # A cache that kept every token (default chunks): a crop anywhere is exact.
    cache = m.new_cache(64)
    m.logits(ids, cache)
    assert cache.crop_point(12) == 12
    cache.crop(12)
    got = m.logits(other[:, :6], cache)
    want = _theirs(folders[family], torch.cat([ids[:, :12], other[:, :6]], 1))[:, 12:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # A cache whose sliding layers dropped the tokens before the crop point says so.
    small = _small_chunk_cache(m)
    for t in range(SEQ_LEN):
        m.logits(ids[:, t : t + 1], small)
    assert small.crop_point(12) == 0
    with pytest.raises(ValueError, match="sliding-window"):
        small.crop(12)
    # One token back is always exact: the sliding layers keep the whole window.
    assert small.crop_point(SEQ_LEN - 1) == SEQ_LEN - 1
    small.crop(SEQ_LEN - 1)
    got = m.logits(other[:, :3], small)
    want = _theirs(folders[family], torch.cat([ids[:, :-1], other[:, :3]], 1))[:, SEQ_LEN - 1 :]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_window_really_matters(models):
    """Without its window (every layer full) Gemma 3 gives other logits past the window."""
    m = models["gemma3"]
    ids = _ids()
    windowed = m.logits(ids)
    attns = [block.attn for block in m.decoder.blocks]
    try:
        for a in attns:
            a.window = None
        unwindowed = m.logits(ids)
    finally:
        for a, w in zip(attns, m.config.windows):
            a.window = w
    torch.testing.assert_close(unwindowed[:, :WINDOW], windowed[:, :WINDOW], atol=1e-5, rtol=1e-5)
    assert (unwindowed[:, WINDOW:] - windowed[:, WINDOW:]).abs().max() > 1e-2


def test_session_reuses_the_cache_and_prefills_again_when_the_window_is_gone(models):
    """A regenerate after the sliding layers dropped the prompt's start: correct text, from a fresh prefill."""
    from runtime import ChatSession, GenerationSettings, SamplingParams

    m = models["gemma3"]
    settings = GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=12, prefill_chunk=4)
    s = ChatSession(m, settings=settings)
    s.cache = _small_chunk_cache(m, 128)  # tokens out of the window are really dropped
    first = s.run(s.send("the cat is very happy and so are we"))
    again = s.run(s.regenerate())
    assert again.text == first.text
    assert again.stats.reused_tokens == 0  # the window before the reply was gone
    fresh = ChatSession(m, settings=settings)  # the default cache keeps every token here
    fresh.run(fresh.send("the cat is very happy and so are we"))
    assert fresh.run(fresh.regenerate()).stats.reused_tokens > 0


def test_unsupported_models_get_one_clear_line():
    from transformers import BertConfig, MixtralConfig, Qwen3MoeConfig

    for hf, words in ((MixtralConfig(), "mixture-of-experts"), (Qwen3MoeConfig(), "mixture-of-experts"), (BertConfig(), "encoder")):
        with pytest.raises(UnsupportedModelError) as e:
            ModelConfig.from_hf(hf)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_config_survives_a_json_round_trip(models):
    import json

    for family in ("gemma3", "phi3", "llama3"):
        c = models[family].config
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_the_planner_counts_what_the_cache_holds(models):
    """Per layer type, the planner's figures at 30 tokens are the cache's own after 30 tokens."""
    from runtime.memory.planner import plan_for_config

    m = models["gemma3"]  # 2 sliding layers (window 8) and 1 full, 1 KV head of 16: 128 B per layer per token
    cache = m.new_cache(64)
    m.logits(_ids(30), cache)
    p = plan_for_config(m.config, cache_dtype="float32", context=30)
    keys = ("kind", "window", "layers", "bytes_per_token", "tokens", "used_bytes")
    assert [{k: t[k] for k in keys} for t in cache.layer_types()] == p.layer_types == [
        {"kind": "full", "window": None, "layers": 1, "bytes_per_token": 128, "tokens": 30, "used_bytes": 3840},
        {"kind": "sliding", "window": WINDOW, "layers": 2, "bytes_per_token": 256, "tokens": WINDOW, "used_bytes": 2048},
    ]
    assert cache.used_bytes == p.kv_bytes == 5888
    assert cache.stats()["layer_types"] == cache.layer_types()
    variants = {v["name"]: (v["bytes_per_token"], v["bytes_at_context"], v["this_model"]) for v in p.variants}
    assert variants == {
        "multi-head": (2 * 3 * 4 * 16 * 4, 2 * 3 * 4 * 16 * 4 * 30, False),  # 4 KV heads, every layer full
        "multi-query": (384, 384 * 30, False),
        "sliding-window": (384, 3 * 128 * WINDOW, False),  # every layer windowed
        "this model": (384, 5888, True),
    }
    # A budget: sliding layers stop growing, so a 10,000-byte cache holds (10,000 - 2,048) / 128 tokens.
    assert plan_for_config(m.config, cache_dtype="float32", context=30, budget_bytes=10_000).max_context_in_budget == 62


def test_the_attention_snapshot_of_a_sliding_layer_is_a_band(models):
    from runtime import LayerAttention

    m = models["gemma3"]
    ids = _ids(20)[0].tolist()
    sliding, full = LayerAttention(m, ids, 0), LayerAttention(m, ids, 2)
    band, tri = sliding.matrix("max"), full.matrix("max")
    rows = torch.arange(20)[:, None]
    cols = torch.arange(20)[None]
    assert (band[(cols <= rows - WINDOW) | (cols > rows)] == 0).all()  # outside the window: nothing
    assert (band[(cols > rows - WINDOW) & (cols <= rows)] > 0).all()
    assert (tri[cols <= rows] > 0).all()  # the global layer sees every earlier key
    steps = sliding.explain(1, query=19, top=3)
    assert steps.n_keys == WINDOW and min(steps.keys) >= 19 - WINDOW + 1
    # The snapshot's row is what the decoder computed (captured weights of the same layer).
    from runtime import AttentionCapture

    with AttentionCapture(m) as cap:
        m.logits(ids)
    torch.testing.assert_close(cap.weights[0][0].max(0).values.float(), band, atol=1e-5, rtol=1e-5)
