"""The decoder's weights from a GGUF's blocks (runtime.weights.gguf.names), dequantized, equal
transformers' own reading of the same tiny files (its dequantizer, its q/k un-permutation,
its Gemma norms), mapped by runtime.weights' names."""
from __future__ import annotations

import pytest
import torch

from runtime.weights.gguf.names import _llama_unpermute, gguf_weights
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.quant_types import dequantize
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf


def _transformers_state(path):
    """transformers' dequantized tensors in our decoder's names (the reference for our own reader)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from runtime.config.model import ModelConfig
    from runtime.weights.convert import to_decoder_state
    from runtime.weights.gguf.converted import _TensorNames

    hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf)
    names = _TensorNames(hf, skeleton.state_dict().keys())
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names)["tensors"]
    cfg = ModelConfig.from_hf(hf)
    return cfg, to_decoder_state(cfg, tensors, torch.float32)


def _ours(path, cfg, fuse=True):
    g = read_gguf_tensors(path)
    w = gguf_weights(g, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, fuse=fuse)
    state = dict(w.floats)
    for name, parts in w.matrices.items():
        state[name + ".weight"] = torch.cat([dequantize(p.raw, p.btype, p.shape) for p in parts])
    state["embed.weight"] = dequantize(w.embed.raw, w.embed.btype, w.embed.shape)
    return w, state


@pytest.mark.parametrize("arch, overrides", [("llama", EVERY_TYPE), ("llama", None), ("gemma3", {"attn_v.weight": "Q8_0"})])
@pytest.mark.parametrize("fuse", [True, False])
def test_raw_weights_equal_transformers_reading(tmp_path, arch, overrides, fuse):
    path = make_tiny_gguf(tmp_path, matrix_type="Q4_K", overrides=overrides, embed_type="Q8_0", arch=arch)
    cfg, ref = _transformers_state(path)
    w, ours = _ours(path, cfg, fuse)
    assert set(ours) == set(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-6 if "norm" in name else 0, msg=name)
    qkv = w.matrices["blocks.0.attn.qkv_proj"]
    if fuse and overrides is None:
        assert len(qkv) == 1 and len(w.matrices["blocks.0.mlp.gate_up_proj"]) == 1
    if overrides is EVERY_TYPE:
        assert len(qkv) == 3  # three types: three products
    assert w.head is None and w.file_type == "Q4_K_M"


def test_unpermute_is_transformers_reverse_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.arange(64 * 3, dtype=torch.float32).view(64, 3).numpy()
    ref = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 4})._reverse_permute_weights(w, 4, 4)
    assert (w[_llama_unpermute(64, 4).numpy()] == ref).all()


def test_fused_parts_are_not_pages_of_the_map(tmp_path):
    path = make_tiny_gguf(tmp_path)
    g = read_gguf_tensors(path)
    w = gguf_weights(g, 2, 4, 2)
    base = g.mapped().untyped_storage().data_ptr()
    assert w.matrices["blocks.0.attn.qkv_proj"][0].raw.untyped_storage().data_ptr() != base
    assert w.matrices["blocks.0.attn.o_proj"][0].raw.untyped_storage().data_ptr() == base
    assert w.embed.raw.untyped_storage().data_ptr() == base
    assert w.nbytes <= path.stat().st_size
