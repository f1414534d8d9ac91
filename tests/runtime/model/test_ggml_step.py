"""The ggml decode step (runtime.model.ggml_step) against the eager step on tiny GGUFs: the
same logits to rounding (both run ggml's products on the blocks), the same KV cache, and the
eager path wherever Python must run per layer."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.kernels import ggml_ops
from runtime.model.quant_layers import ggml_step_unsupported as unsupported
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")

IDS = list(range(4, 40)) + [7, 9, 11]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def files(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"ggml-step-{request.param}")
    return make_tiny_gguf(folder, tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE,
                          embed_type="Q8_0", arch=request.param), folder


@pytest.fixture(scope="module")
def pair(files):
    path, folder = files
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    mp.setenv("ATTNCHAT_KERNELS", "default")   # ggml decodes in both: the products' arithmetic is the same
    try:
        yield (load_model(path, device="cpu", decode="eager", threads=1),
               load_model(path, device="cpu", threads=1))
    finally:
        mp.undo()


def _decode(model, ids, n: int, dtype=None):
    """Teacher-forced decode logits ``(n, V)`` after a prefill of ``ids[:-n]``, and the cache."""
    cache = model.new_cache(len(ids) + 1, dtype=dtype)
    model.logits(ids[:-n], cache)
    return torch.stack([model.decode_next(t, cache)[0, -1].clone() for t in ids[-n:]]), cache


def test_a_gguf_on_the_cpu_decodes_through_ggml_by_default(pair):
    eager, ggml = pair
    assert eager.decode_mode == "eager" and ggml.decode_mode == "ggml"
    assert unsupported(ggml.decoder) is None


@pytest.fixture(scope="module")
def float32(files):
    path, folder = files
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    try:
        yield load_model(path, device="cpu", dtype="float32", decode="eager", threads=1)
    finally:
        mp.undo()


def test_logits_are_as_close_to_float32_as_the_eager_steps(pair, float32):
    eager, ggml = pair
    with torch.inference_mode():
        # float32 caches: the steps' own arithmetic compared, not the blocks' default float16
        # cache's rounding (tests/runtime/model/test_ggml_token.py covers the 16-bit caches)
        a, ca = _decode(eager, IDS, 12, "float32")
        b, cb = _decode(ggml, IDS, 12, "float32")
        f, _ = _decode(float32, IDS, 12)
    assert ggml._step._ggml, "the ggml step was not built"
    # Both round a product's activations to 8 bits per block (ggml's products); ggml's norms
    # and activations differ from torch's in the last bits, which can flip one of those
    # roundings: the two steps differ by about as much as each differs from float32
    # (measured mean |diff| to float32: 0.04123 eager, 0.04123 ggml on the llama file;
    # 0.04766 and 0.04776 on the gemma3 one).
    err_eager, err_ggml = (a - f).abs().mean().item(), (b - f).abs().mean().item()
    assert err_ggml <= 1.5 * err_eager + 1e-3, (err_ggml, err_eager)
    assert (b.argmax(-1) == f.argmax(-1)).float().mean() >= 0.9
    assert ca.length == cb.length == len(IDS)
    for layer in range(len(ca.k)):
        n = ca.held(layer)
        assert cb.held(layer) == n
        assert (cb.k[layer][:, :, :n].float() - ca.k[layer][:, :, :n].float()).abs().mean() < 0.01
        assert (cb.v[layer][:, :, :n].float() - ca.v[layer][:, :, :n].float()).abs().mean() < 0.01


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_head_norms_and_rope_are_the_eager_formulas(pair, dtype):
    """Given the step's own q/k/v product, its rotated queries and keys are the eager
    path's (q/k head norms where the family has them, RoPE from the same tables), in the
    one-graph token (a float cache) and the per-layer graphs (an int8 cache)."""
    from runtime.model.rope import apply_rope

    _, ggml = pair
    dec = ggml.decoder
    with torch.inference_mode():
        _, cache = _decode(ggml, IDS, 2, dtype=dtype)
        step = ggml._step._ggml
        if dtype == "float32":
            assert step.token_graph(cache) is not None
            step = step.tokens[torch.float32]
        else:
            assert step.token_graph(cache) is None and step.graphs
        H, Hkv, D = ggml.decoder.cfg.n_heads, ggml.decoder.cfg.n_kv_heads, ggml.decoder.cfg.head_dim
        pos = cache.length - 1
        for layer, block in enumerate(dec.blocks):
            qkv = step.qkv[layer]
            q = qkv[:H * D].view(1, 1, H, D).transpose(1, 2)
            k = qkv[H * D:(H + Hkv) * D].view(1, 1, Hkv, D).transpose(1, 2)
            if block.attn.q_norm is not None:
                q, k = block.attn.q_norm(q), block.attn.k_norm(k)
            cos, sin = dec.rope(layer, pos, 1)
            torch.testing.assert_close(step.qk[layer][:H], apply_rope(q, cos, sin)[0, :, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step.qk[layer][H:], apply_rope(k, cos, sin)[0, :, 0], rtol=1e-5, atol=1e-5)
            if dtype == "float32":  # and the cache holds exactly those keys and values at the newest position
                newest = cache.held(layer) - 1
                torch.testing.assert_close(cache.k[layer][0, :, newest], step.qk[layer][H:], rtol=0, atol=0)
                torch.testing.assert_close(cache.v[layer][0, :, newest].reshape(-1), qkv[(H + Hkv) * D:], rtol=0, atol=0)


def test_python_per_layer_takes_the_eager_step(pair):
    eager, ggml = pair
    seen = []
    ggml.decoder.observer = lambda layer, w: seen.append(layer)
    try:
        with torch.inference_mode():
            a, _ = _decode(eager, IDS, 3)
            b, _ = _decode(ggml, IDS, 3)
    finally:
        ggml.decoder.observer = None
    assert len(seen) == 3 * ggml.config.n_layers + ggml.config.n_layers  # the prefill, then every token
    torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_float_weights_and_the_reproducible_mode_stay_eager(files):
    path, folder = files
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    try:
        assert load_model(path, device="cpu", dtype="float32", threads=1).decode_mode == "eager"
    finally:
        mp.undo()


def test_projections_off_the_cpu_are_not_taken(pair):
    """A projection kept on another device (what a GPU load makes) takes the eager step: the
    device test, reached here by moving one layer's recorded device."""
    _, ggml = pair
    layer = ggml.decoder.blocks[0].attn.o_proj
    was = layer.device
    layer.device = torch.device("meta")
    try:
        assert unsupported(ggml.decoder) == "a projection is not in GGUF blocks on the CPU"
    finally:
        layer.device = was
    assert unsupported(ggml.decoder) is None
