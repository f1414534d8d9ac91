"""Eviction by a cache policy on real (tiny) decoders: decoding with eviction equals a
full-cache reference whose attention is masked to the positions the cache kept.

The reference is written here from the decoder's own pieces: token by token, each layer
projects q, k, v at the token's true position (RoPE once, never re-rotated), appends k, v
to a full list, and attends with :func:`attention_reference` under a mask that allows
exactly the positions the evicting cache held when that token was fed (and, for a
sliding layer, its window). The evicting run is the ordinary path: ``Model.logits`` on a
:class:`KVCache` with an :class:`Evictor` attached, evicting after every forward.
"""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.policies.evictor import Evictor, budget_for_bytes
from runtime.insight.probe import AttentionCapture
from runtime.model.attention import attention_reference
from runtime.quantize import dequantize_int8, quantize_int8
from tests.runtime.tiny_models import make_tiny_model

PROMPT = list(range(40, 62))  # 22 ordinary byte tokens
CHUNK = 8
BUDGET, STEP = 10, 3
DECODE = 18


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("evict")
    return {f: load_model(make_tiny_model(root, f), device="cpu", dtype="float32") for f in ("llama", "gemma2", "gemma3")}


def _evicting_run(model, policy, *, dtype=None, budget=BUDGET, step=STEP):
    """Prefill PROMPT in chunks, then greedy-decode: (fed chunks with the positions each layer
    held before them, logits of each chunk's last token, the cache)."""
    cache = model.new_cache(128, dtype=dtype)
    ev = Evictor(policy, budget, step=step).attach(cache) if policy else None
    fed, rows, evictions = [], [], 0
    L = model.config.n_layers

    def feed(ids):
        nonlocal evictions
        fed.append((cache.length, list(ids), [cache.positions(i).clone() for i in range(L)]))
        row = model.logits(ids, cache, last_only=True)[0, -1]
        if ev is not None:
            evictions += ev.evict(cache) > 0
        rows.append(row)
        return row

    for a in range(0, len(PROMPT), CHUNK):
        row = feed(PROMPT[a:a + CHUNK])
    for _ in range(DECODE):
        row = feed([int(row.argmax())])
    return fed, torch.stack(rows), cache, evictions


def _reference(model, fed, *, int8=False):
    """Logits of each fed chunk's last token with attention masked to the held positions."""
    dec = model.decoder
    cfg = model.config
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    K = [[] for _ in range(cfg.n_layers)]
    V = [[] for _ in range(cfg.n_layers)]
    rows = []
    with torch.inference_mode():
        for start, ids, held in fed:
            for p, tok in zip(range(start, start + len(ids)), ids):
                x = dec.embed(torch.tensor([[tok]])).to(dec.compute_dtype) * cfg.embed_scale
                for i, block in enumerate(dec.blocks):
                    q, k, v = block.attn.project(block.attn_norm(x), dec.rope(i, p, 1))
                    if int8:
                        k, v = dequantize_int8(*quantize_int8(k)), dequantize_int8(*quantize_int8(v))
                    K[i].append(k)
                    V[i].append(v)
                    allowed = torch.zeros(Hkv, p + 1, dtype=torch.bool)
                    allowed.scatter_(-1, held[i][0], True)  # what the cache held before this chunk
                    allowed[:, start:p + 1] = True  # this chunk's tokens up to this one
                    w = cfg.windows[i]
                    if w is not None:
                        allowed[:, : max(0, p - w + 1)] = False
                    mask = allowed.repeat_interleave(H // Hkv, dim=0).view(1, H, 1, p + 1)
                    y, _ = attention_reference(q, torch.cat(K[i], 2), torch.cat(V[i], 2), causal=False, mask=mask,
                                               scale=block.attn.scale, softcap=block.attn.softcap)
                    y = y.transpose(1, 2).reshape(1, 1, -1)
                    x = x + block.post_attn_norm(block.attn.o_proj(y))
                    x = x + block.post_mlp_norm(block.mlp(block.mlp_norm(x)))
            rows.append(dec._logits(dec.final_norm(x))[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("family,policy,dtype", [
    ("llama", "sinks-window", None), ("llama", "h2o", None), ("llama", "snapkv", None),
    ("llama", "tova", None), ("llama", "key-norm", None),
    ("gemma2", "h2o", None),          # soft-capped scores, alternating sliding/full layers
    ("gemma3", "snapkv", None),       # multi-query, q/k norms, sliding + global RoPE
    ("llama", "tova", "int8"), ("gemma3", "key-norm", "int8"),
])
def test_decoding_with_eviction_equals_a_masked_full_cache(models, family, policy, dtype):
    model = models[family]
    fed, rows, cache, evictions = _evicting_run(model, policy, dtype=dtype)
    assert evictions >= 6 and cache.length == len(PROMPT) + DECODE
    assert cache.held_tokens < BUDGET + STEP and cache.evicted == cache.length - cache.held_tokens
    ref = _reference(model, fed, int8=dtype == "int8")
    torch.testing.assert_close(rows, ref, atol=2e-4, rtol=1e-4)
    # Not vacuous: the full cache decodes other logits once tokens are gone.
    full_ref = _reference(model, [(s, ids, [torch.arange(s).expand(1, model.config.n_kv_heads, s)] * model.config.n_layers)
                                  for s, ids, _ in fed], int8=dtype == "int8")
    assert (rows - full_ref).abs().max() > 1e-2


def test_heads_keep_different_positions_and_sliding_layers_keep_their_window(models):
    _, _, cache, _ = _evicting_run(models["llama"], "h2o")
    p = cache.positions(0)
    assert p.shape == (1, 2, cache.held_tokens) and not torch.equal(p[0, 0], p[0, 1])
    assert (p.diff(dim=-1) > 0).all()  # ascending: the buffer stays in position order
    _, _, cache, _ = _evicting_run(models["gemma3"], "tova")
    assert cache.windows == (8, 8, None)
    assert cache.positions(0)[0, 0].tolist() == list(range(cache.start[0], cache.length))  # untouched
    assert cache.held_mask(2).sum().item() == cache.held_tokens


def test_h2o_accumulates_the_models_own_attention(models):
    model = models["gemma2"]  # soft-capping and a sliding layer
    cache = model.new_cache(64)
    ev = Evictor("h2o", 1000).attach(cache)
    for a in range(0, len(PROMPT), CHUNK):
        model.logits(PROMPT[a:a + CHUNK], cache)
    with AttentionCapture(model) as cap:
        model.logits(PROMPT)  # no cache: every query's weights (B, H, T, T)
    G = model.config.n_heads // model.config.n_kv_heads
    for i in cache.full_layers():
        want = cap.weights[i][0].sum(dim=1)  # (H, T): attention received, summed over queries
        want = want.view(model.config.n_kv_heads, G, -1).mean(dim=1)
        got = ev.observation(cache, i).accumulated[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_crop_restores_only_what_no_later_eviction_touched(models):
    model = models["llama"]
    cache = model.new_cache(128)
    ev = Evictor("sinks-window", 12, step=4).attach(cache)
    model.logits(list(range(40, 54)), cache)  # 14 tokens: nothing evicted yet (due at 16)
    model.logits(list(range(60, 64)), cache)  # 18: evict 6 (positions 4..9), at length 18
    assert ev.evict(cache) == 6 and cache.evictions == [(18, 4, 6)]
    assert cache.positions(0)[0, 0].tolist() == [0, 1, 2, 3, *range(10, 18)]
    assert cache.crop_point(18) == 18 and cache.crop_point(12) == 4 and cache.crop_point(3) == 3
    model.logits([70, 71, 72], cache)  # 21 tokens, 15 held
    assert cache.crop_point(19) == 19
    cache.crop(19)
    assert (cache.length, cache.held_tokens, cache.evicted) == (19, 13, 6)
    assert cache.positions(0)[0, 1].tolist() == [0, 1, 2, 3, *range(10, 19)]
    with pytest.raises(ValueError, match="crop"):
        cache.crop(12)
    cache.crop(4)  # before the eviction: the cache as it was, nothing evicted
    assert (cache.length, cache.held_tokens, cache.evicted, cache.evictions) == (4, 4, 0, [])
    # And it decodes as a fresh cache does from there.
    fresh = model.new_cache(128)
    model.logits(list(range(40, 44)), fresh)
    torch.testing.assert_close(model.logits([99], cache), model.logits([99], fresh))


def test_budget_from_bytes_counts_sliding_windows_whole(models):
    cache = models["gemma3"].new_cache(128)  # layers: sliding 8, sliding 8, full; 1 KV head, D 16
    per_layer = 2 * 1 * 16 * 4
    assert budget_for_bytes(cache, per_layer * (2 * 8 + 20)) == 20
    with pytest.raises(ValueError, match="does not hold one token"):
        budget_for_bytes(cache, per_layer * 16)
    with pytest.raises(ValueError, match="'none' cache policy"):
        Evictor("none", 10)
