"""Granite 3, OLMo 2 and SmolLM3 GGUFs, the families transformers' GGUF reader does not read:
their released shapes load from the header, and tiny random-weight files give transformers'
logits, on both of our decode paths.

The reference is transformers' own class for each family (``GraniteForCausalLM``,
``Olmo2ForCausalLM``, ``SmolLM3ForCausalLM``) built from a config the test writes from the
shape (not from our reading of the file), with the file's tensors dequantized by gguf-py
(``GGUFReader`` + ``gguf.quants.dequantize``) under transformers' names, Granite's and
SmolLM3's q/k rows un-permuted by transformers' own llama function (their llama.cpp
converters are llama's, which permutes them; OLMo 2's is not).
"""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.config.model import ModelConfig
from runtime.kernels import ggml_ops
from runtime.weights.gguf import config as gguf_config
from runtime.weights.gguf.names import gguf_weights
from runtime.weights.gguf.open import open_gguf
from runtime.weights.gguf.write import REAL_SHAPES, SHAPES, write_random_gguf
from tests.runtime.tiny_gguf import tiny_tokenizer_metadata

OWN = [name for name, (arch, _, _) in sorted(REAL_SHAPES.items()) if arch in gguf_config.OWN_ARCHITECTURES]
MULTIPLIERS = (12.0, 0.015625, 0.22, 8.0)   # Granite 3.3 2B's (embedding, attention, residual, logits)
IDS = [5, 17, 42, 99, 3, 250, 7, 128, 64, 11, 200, 31]


def test_the_three_families_have_released_shapes():
    assert {REAL_SHAPES[n][0] for n in OWN} == {"granite", "olmo2", "smollm3"} and len(OWN) == 5


@pytest.mark.parametrize("name", OWN)
def test_a_released_models_shape_loads(tmp_path, name):
    arch, shape, title = REAL_SHAPES[name]
    path = write_random_gguf(tmp_path / f"{name}.gguf", shape, matrix_type="Q4_0", embed_type="Q8_0", arch=arch,
                             name=title, zeros=True)
    g = open_gguf(path)
    hf = gguf_config.hf_config(g)
    assert type(hf).__name__ == {"granite": "GraniteConfig", "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config"}[arch]
    cfg = ModelConfig.from_hf(hf)
    H, D = shape.hidden, shape.head_dim
    assert (cfg.model_type, cfg.n_layers, cfg.hidden_size, cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (
        arch, shape.n_layers, H, shape.ffn, shape.heads, shape.kv_heads, D, shape.vocab, shape.tied)
    assert cfg.rope.theta == shape.rope_base and cfg.norm_eps == pytest.approx(shape.eps)
    if arch == "granite":
        # (float32 in the file)
        assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logits_scaling) == pytest.approx(
            shape.multipliers, rel=1e-6)
    else:
        assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logits_scaling) == (1.0, 0.0, 1.0, 1.0)
    # SmolLM3: llama.cpp skips RoPE on every fourth layer (no key says so)
    assert cfg.nope_layers == (tuple(range(3, shape.n_layers, 4)) if arch == "smollm3" else ())
    assert (cfg.pre_norms, cfg.sandwich_norms, cfg.qk_norm, cfg.qk_norm_whole) == (
        (False, True, True, True) if arch == "olmo2" else (True, False, False, False))
    w = gguf_weights(g, 2, cfg.n_heads, cfg.n_kv_heads, fuse=False)
    q, kv = shape.heads * D, shape.kv_heads * D
    for i in range(2):
        b = f"blocks.{i}."
        assert sum(p.rows for p in w.matrices[b + "attn.qkv_proj"]) == q + 2 * kv
        norms = {k.removeprefix(b) for k in w.floats if k.startswith(b)}
        assert norms == ({"post_attn_norm.weight", "post_mlp_norm.weight", "attn.q_norm.weight", "attn.k_norm.weight"}
                         if arch == "olmo2" else {"attn_norm.weight", "mlp_norm.weight"})
        if arch == "olmo2":
            assert (w.floats[b + "attn.q_norm.weight"].shape, w.floats[b + "attn.k_norm.weight"].shape) == ((q,), (kv,))


def _tiny(arch: str):
    shape = SHAPES["tiny"]
    return type(shape)(**{**shape.__dict__, "tied": arch != "olmo2",
                          "n_layers": 4 if arch == "smollm3" else 2,   # SmolLM3's fourth layer has no RoPE
                          "multipliers": MULTIPLIERS if arch == "granite" else ()})


def _reference(path, arch: str, shape, **changes):
    """transformers' model of the family from the shape, with the file's tensors (gguf-py's reading)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    kw = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
              num_hidden_layers=shape.n_layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
              max_position_embeddings=shape.context, rms_norm_eps=shape.eps, tie_word_embeddings=shape.tied,
              rope_parameters={"rope_type": "default", "rope_theta": shape.rope_base},
              pad_token_id=None, bos_token_id=None, eos_token_id=None)   # (SmolLM3's defaults pass a tiny vocabulary)
    if arch == "granite":
        kw.update(zip(("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"),
                      shape.multipliers))
    kw.update(changes)
    config = AutoConfig.for_model(arch, **kw)
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads})
    state = {}
    for t in GGUFReader(str(path)).tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape([int(d) for d in t.shape[::-1]])
        if t.name in top:
            state[top[t.name]] = torch.from_numpy(w.copy())
            continue
        _, layer, kind, _ = t.name.split(".")
        if arch != "olmo2" and kind in ("attn_q", "attn_k"):
            w = unpermute._reverse_permute_weights(w, shape.heads, shape.heads if kind == "attn_q" else shape.kv_heads)
        state[f"model.layers.{layer}.{per_layer[kind]}.weight"] = torch.from_numpy(np.array(w))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if shape.tied:
        model.tie_weights()
    return model


@pytest.mark.parametrize("arch", ["granite", "olmo2", "smollm3"])
def test_a_tiny_file_gives_transformers_logits(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    shape = _tiny(arch)
    path = write_random_gguf(tmp_path / f"{arch}.gguf", shape, matrix_type="Q8_0", embed_type="Q8_0", arch=arch,
                             tokenizer=tiny_tokenizer_metadata(), std=0.1, seed=3, name=f"{arch} tiny")
    shape = type(shape)(**{**shape.__dict__, "vocab": open_gguf(path).tensors["token_embd.weight"].shape[0]})
    ref = _reference(path, arch, shape)
    ours = load_model(path, device="cpu", dtype="float32")
    with torch.inference_mode():
        theirs = ref(torch.tensor([IDS])).logits[0]
        mine = ours.logits(IDS)[0]
    assert theirs.std() > 0.1  # logits that tell tokens and positions apart
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # what the family's piece changes: without it transformers' model gives other logits
    plain = {"granite": dict(embedding_multiplier=1.0, attention_multiplier=shape.head_dim ** -0.5,
                             residual_multiplier=1.0, logits_scaling=1.0),
             "smollm3": dict(no_rope_layers=[1] * shape.n_layers), "olmo2": None}[arch]
    if plain is not None:
        with torch.inference_mode():
            assert (_reference(path, arch, shape, **plain)(torch.tensor([IDS])).logits[0] - theirs).abs().max() > 0.01


@pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")
@pytest.mark.parametrize("arch", ["granite", "olmo2", "smollm3"])
def test_the_blocks_decode_through_ggml_in_one_graph_and_per_layer(tmp_path, monkeypatch, arch):
    """The file's own blocks (the app's default): the prefill, the one-graph decode token and the
    per-layer graphs all pick transformers' next tokens and stay within ggml's activation rounding."""
    from runtime.model.ggml_step import GGMLStep

    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    shape = _tiny(arch)
    path = write_random_gguf(tmp_path / f"{arch}.gguf", shape, matrix_type="Q8_0", embed_type="Q8_0", arch=arch,
                             tokenizer=tiny_tokenizer_metadata(), std=0.1, seed=3, name=f"{arch} tiny")
    shape = type(shape)(**{**shape.__dict__, "vocab": open_gguf(path).tensors["token_embd.weight"].shape[0]})
    with torch.inference_mode():
        theirs = _reference(path, arch, shape)(torch.tensor([IDS])).logits[0]
    m = load_model(path, device="cpu", threads=1)
    assert m.decode_mode == "ggml"
    prefill = 4

    def decode():
        cache = m.new_cache(len(IDS) + 1, dtype="float32")
        with torch.inference_mode():
            first = m.logits(IDS[:prefill], cache)[0]
            steps = [m.decode_next(t, cache)[0, -1].clone() for t in IDS[prefill:-1]]
        return torch.cat([first, torch.stack(steps)]), cache

    one, cache = decode()
    assert m._step._ggml.token_graph(cache) is not None and cache.dtype in m._step._ggml.tokens
    monkeypatch.setattr(GGMLStep, "token_graph", lambda self, c: None)
    layers, _ = decode()
    assert m._step._ggml.graphs, "the per-layer graphs did not run"
    ref = theirs[: len(IDS) - 1]
    for got in (one, layers):
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
        assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert (one - layers).abs().max().item() <= 0.02 * ref.abs().max().item() + 1e-4


def test_an_all_float16_file_is_widened_from_our_names(tmp_path, monkeypatch):
    """transformers' GGUF reader (the route of other families' all-float files) cannot read these."""
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    shape = _tiny("olmo2")
    path = write_random_gguf(tmp_path / "olmo2-f16.gguf", shape, matrix_type="F16", embed_type="F16", arch="olmo2",
                             tokenizer=tiny_tokenizer_metadata(), std=0.1, seed=4, name="olmo2 tiny f16")
    shape = type(shape)(**{**shape.__dict__, "vocab": open_gguf(path).tensors["token_embd.weight"].shape[0]})
    ours = load_model(path, device="cpu", dtype="float32")
    assert ours.decode_mode != "ggml"   # float weights: no blocks to run
    with torch.inference_mode():
        torch.testing.assert_close(ours.logits(IDS)[0], _reference(path, "olmo2", shape)(torch.tensor([IDS])).logits[0],
                                   rtol=1e-4, atol=1e-4)
