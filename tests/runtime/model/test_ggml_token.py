"""The one-graph decode token (runtime/model/ggml_token.py) against the per-layer graphs, on
tiny GGUFs: the same logits and cache contents for every float cache dtype, through sliding
windows, cache growth and two caches taking turns."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.kernels import ggml_ops
from runtime.model.ggml_step import GGMLStep
from runtime.model.ggml_token import cache_unsupported
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")

IDS = [(7 * i + 3) % 300 + 4 for i in range(48)]
PREFILL = 8
WINDOW = 6   # gemma3's sliding layers: the decode passes it, so their keys are trimmed


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"ggml-token-{request.param}")
    path = make_tiny_gguf(folder, tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE,
                          embed_type="Q8_0", arch=request.param, window=WINDOW)
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    mp.setenv("ATTNCHAT_KERNELS", "default")
    try:
        m = load_model(path, device="cpu", threads=1)
        assert m.decode_mode == "ggml"
        yield m
    finally:
        mp.undo()


def _decode(model, cache, ids):
    with torch.inference_mode():
        model.logits(ids[:PREFILL], cache)
        return torch.stack([model.decode_next(t, cache)[0, -1].clone() for t in ids[PREFILL:]])


def _cache(model, dtype):
    cache = model.new_cache(len(IDS) + 1, dtype=dtype)
    cache.chunk_tokens = 16   # the buffers grow (and move) twice during the decode
    return cache


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_one_graph_decodes_as_the_per_layer_graphs(model, dtype, monkeypatch):
    one = _cache(model, dtype)
    a = _decode(model, one, IDS)
    step = model._step._ggml
    assert step.token_graph(one) is not None and one.dtype in step.tokens
    monkeypatch.setattr(GGMLStep, "token_graph", lambda self, cache: None)
    per_layer = _cache(model, dtype)
    b = _decode(model, per_layer, IDS)
    assert step.graphs, "the per-layer graphs did not run"
    assert one.length == per_layer.length == len(IDS)
    if dtype == "float32":
        # Attention differs only in its summation order (ggml's online softmax against SDPA),
        # which the next product's 8-bit activation rounding hides unless a value sits on a
        # rounding boundary: then one code flips and that token's logits move by a few
        # percent (measured: every row equal on a Zen 3; on an Intel Xeon with AVX-512, 1 row
        # of 40 off by 0.041 at most, mean |logit| 1.28).
        diff = (a - b).abs()
        scale = b.abs().mean().item()
        assert (diff.amax(-1) == 0).float().mean().item() >= 0.9
        assert diff.mean().item() <= 1e-3 * scale
        assert diff.max().item() <= 0.1 * scale
        assert (a.argmax(-1) == b.argmax(-1)).all()
        tol = 1e-3
    else:
        # A 16-bit cache: ggml reads the query and the values at 16 bits too (torch widens
        # the keys and values to float32). Against the float32 cache, both paths are off by
        # the cache's own rounding (measured mean |diff| 0.036 / 0.033 float16, 0.042 / 0.041
        # bfloat16 on the llama file; 0.043 / 0.041 and 0.051 / 0.051 on the gemma3 one).
        ref = _decode(model, _cache(model, "float32"), IDS)
        err_one, err_layers = (a - ref).abs().mean().item(), (b - ref).abs().mean().item()
        assert 0 < err_one <= 1.25 * err_layers + 1e-3, (err_one, err_layers)
        assert (a.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
        tol = 0.02
    for layer in range(model.config.n_layers):
        n = one.held(layer)
        assert per_layer.held(layer) == n and one.k[layer].shape == per_layer.k[layer].shape
        for x, y in ((one.k, per_layer.k), (one.v, per_layer.v)):
            x, y = x[layer][:, :, :n].float(), y[layer][:, :, :n].float()
            assert (x - y).abs().mean().item() <= tol * y.abs().mean().item() + 1e-6, layer


def test_the_sliding_layers_trim_their_keys(model):
    windows = [b.attn.window for b in model.decoder.blocks]
    cache = _cache(model, "float32")
    _decode(model, cache, IDS)
    tg = model._step._ggml.tokens[torch.float32]
    for lay, w, i in zip(tg.layers, windows, range(len(windows))):
        n = lay.reads[0].ne[1]
        # the last token attended over min(window, every position) keys of its layer
        assert n == (min(w, len(IDS)) if w else len(IDS)), (i, n, w)
    if any(windows):
        assert min(lay.reads[0].ne[1] for lay in tg.layers) == WINDOW


def test_two_caches_taking_turns_decode_as_each_alone(model):
    alone = [_decode(model, _cache(model, "float32"), ids) for ids in (IDS, IDS[::-1])]
    first, second = _cache(model, "float32"), _cache(model, "float32")
    out: list[list[torch.Tensor]] = [[], []]
    with torch.inference_mode():
        model.logits(IDS[:PREFILL], first)
        model.logits(IDS[::-1][:PREFILL], second)
        for a, b in zip(IDS[PREFILL:], IDS[::-1][PREFILL:]):
            out[0].append(model.decode_next(a, first)[0, -1].clone())
            out[1].append(model.decode_next(b, second)[0, -1].clone())
    for got, want in zip(out, alone):
        torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=0)


def test_caches_the_graph_cannot_take_say_why(model):
    assert cache_unsupported(model.new_cache(16)) is None
    assert cache_unsupported(model.new_cache(16, dtype="int8")) == "a torch.int8 cache"
    from runtime.cache.kv_cache import KVCache

    cfg = model.config
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16)
    # a cache off the CPU (the meta device stands for a GPU here) and a batch of two take the per-layer graphs
    assert cache_unsupported(KVCache(*shape, device="meta")) == "a batch or a device other than the CPU"
    assert cache_unsupported(KVCache(*shape, batch=2)) == "a batch or a device other than the CPU"
