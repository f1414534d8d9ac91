"""Every GGUF family attnchat runs (llama, mistral, qwen2, qwen3, gemma3, phi3) from files of
the released models' shapes and metadata, and from tiny random-weight files against transformers.

The released shapes (Llama 3.2 1B/3B, Qwen2.5 0.5B-7B, Qwen3 0.6B-8B, Gemma 3 1B/4B, Phi-3.5-mini,
Phi-4-mini, SmolLM2 1.7B, Mistral 7B: :data:`runtime.weights.gguf.write.REAL_SHAPES`) are written
with zero weights as sparse files (a few kilobytes on disk for a 5 GB tensor table): the header
walk takes them, the config we read equals the one transformers reads from the same file, and
the decoder's matrices come out of the table in the shapes the config asks for. The tiny files
(2 layers, hidden 256) carry random weights, so the decoder's arithmetic per family is checked
against transformers' own model loaded from the same GGUF.
"""
from __future__ import annotations

import math

import pytest
import torch

from runtime import load_model
from runtime.config.model import ModelConfig
from runtime.weights.gguf import config as gguf_config
from runtime.weights.gguf.names import gguf_weights
from runtime.weights.gguf.open import open_gguf
from runtime.weights.gguf.write import REAL_SHAPES, SHAPES, write_random_gguf
from tests.runtime.tiny_gguf import tiny_tokenizer_metadata

#: layers mapped into the decoder's names per released shape (llama's q/k un-permutation copies
#: each layer's q and k: all 32 layers of Mistral 7B are 300 MB of zeros read); the rest are
#: checked in the tensor table.
MAPPED_LAYERS = 2


@pytest.mark.parametrize("name", sorted(n for n, (arch, _, _) in REAL_SHAPES.items()
                                  if arch not in gguf_config.OWN_ARCHITECTURES))   # those: test_gguf_granite_olmo2_smollm3
def test_a_released_models_shape_loads(tmp_path, name):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch, shape, title = REAL_SHAPES[name]
    path = write_random_gguf(tmp_path / f"{name}.gguf", shape, matrix_type="Q4_0", embed_type="Q8_0", arch=arch,
                             name=title, zeros=True)
    assert path.stat().st_blocks * 512 < 1 << 20 < path.stat().st_size  # a sparse file: the weights are a hole
    g = open_gguf(path)
    ours = gguf_config.config_dict(g)
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    ours.pop("_model_name_or_path", None), theirs.pop("_model_name_or_path", None)
    if theirs.get("model_type") == "gemma3":
        theirs["model_type"] = "gemma3_text"  # transformers' GGUF reader names the multimodal class
    assert ours == theirs
    cfg = ModelConfig.from_hf(gguf_config.hf_config(g))
    H, D, q, kv = shape.hidden, shape.head_dim, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    assert (cfg.n_layers, cfg.hidden_size, cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            cfg.vocab_size) == (shape.n_layers, H, shape.ffn, shape.heads, shape.kv_heads, D, shape.vocab)
    assert cfg.model_type == theirs["model_type"]
    # Phi-4-mini rotates 96 of its 128 channels (rope.dimension_count, which transformers' reader drops)
    assert cfg.rope.rotary_dim(D) == (shape.rope_dim or D)
    # the RoPE scaling each keeps outside transformers' reading (the global layers' for Gemma 3)
    kind = ("llama3" if shape.llama3_factor else "longrope" if shape.longrope_original
            else "linear" if shape.linear_rope else "default")
    assert (cfg.rope.type, cfg.rope.factor if kind in ("llama3", "linear") else 0.0) == (
        kind, shape.llama3_factor or shape.linear_rope)
    w = gguf_weights(g, MAPPED_LAYERS, cfg.n_heads, cfg.n_kv_heads, fuse=False)
    for i in range(MAPPED_LAYERS):
        b = f"blocks.{i}."
        shapes = {k: [p.shape for p in w.matrices[b + k]] for k in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj",
                                                                  "mlp.down_proj")}
        assert sum(r for r, _ in shapes["attn.qkv_proj"]) == q + 2 * kv and {c for _, c in shapes["attn.qkv_proj"]} == {H}
        assert shapes["attn.o_proj"] == [(H, q)] and shapes["mlp.down_proj"] == [(H, shape.ffn)]
        assert sum(r for r, _ in shapes["mlp.gate_up_proj"]) == 2 * shape.ffn
        assert (b + "attn.qkv_proj.bias" in w.floats) == (arch == "qwen2")
        assert (b + "attn.q_norm.weight" in w.floats) == (arch in ("qwen3", "gemma3"))
    assert w.embed.shape == (shape.vocab, H) and (w.head is None) == shape.tied
    first, last = (sorted((n.split(".", 2)[2], tuple(t.shape)) for n, t in g.tensors.items() if n.startswith(f"blk.{i}."))
                   for i in (0, shape.n_layers - 1))
    assert first == last and f"blk.{shape.n_layers}.attn_norm.weight" not in g.tensors


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer_metadata()


IDS = [5, 17, 42, 99, 3, 250, 7, 128, 64, 11, 200, 31]


# Mistral: llama.cpp writes it as llama ("Mistral 7B Instruct v0.3" reads as llama in transformers
# and here, the llama case); transformers cannot load the tensors of a file it reads as Mistral
# (gguf-py has no "mistral" architecture), so its config alone is compared, in the released shapes.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "phi3-partial-rope", "phi3-longrope",
                                  "llama-llama3-rope", "gemma3-linear-rope", "qwen3-head-96"])
def test_a_tiny_file_of_each_family_gives_transformers_logits(tmp_path, monkeypatch, tokenizer, arch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    arch, _, variant = arch.partition("-")
    shape = SHAPES["tiny"]
    if arch == "qwen3":  # Qwen3's heads are wider than hidden / heads: 128 (every released Qwen3's,
        # and what transformers' reader keeps whatever the file says), or 96 (read from key_length)
        shape = type(shape)(**{**shape.__dict__, "head_dim": 96 if variant == "head-96" else 128})
    untied = arch == "phi3"
    shape = type(shape)(**{**shape.__dict__, "tied": not untied, "rope_dim": 48 if variant == "partial-rope" else None,
                           "llama3_factor": 32.0 if variant == "llama3-rope" else 0.0,
                           "longrope_original": 256 if variant == "longrope" else 0,
                           "linear_rope": 8.0 if variant == "linear-rope" else 0.0,
                           # six layers: Gemma 3's sixth is its first global one, where the scaling applies;
                           # a window under the 512-token context (a window as long as the context is none,
                           # and the sliding layers' own RoPE goes with their window)
                           "n_layers": 6 if variant == "linear-rope" else shape.n_layers,
                           "window": 256 if variant == "linear-rope" else shape.window})
    path = write_random_gguf(tmp_path / f"{arch}.gguf", shape, matrix_type="Q8_0", embed_type="Q8_0", arch=arch,
                             tokenizer=tokenizer, std=0.1, seed=3, name=f"{arch} tiny")
    ours = load_model(path, device="cpu", dtype="float32")
    assert ours.decoder.cfg.n_layers == shape.n_layers and (ours.decoder.lm_head is None) == (not untied)
    config = None
    if variant == "head-96":  # transformers' reader keeps 128: its own class told the file's width
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
        config.head_dim = 96
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                               config=config).eval()
    assert ref.config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert (ref.config.tie_word_embeddings, ours.decoder.cfg.head_dim) == (not untied, shape.head_dim)
    if variant and variant != "head-96":  # transformers' reader drops rope.dimension_count,
        # rope_freqs.weight, the LongRoPE factors and rope.scaling: its own class with the file's RoPE
        # (Phi-3 rotating 48 of 64 channels; Phi-3.5's LongRoPE, short factors up to 256 tokens and
        # long ones past; Llama 3.2's scaling; Gemma 3 4B's linear scaling of its global layers)
        config = ref.config
        if variant == "partial-rope":
            config.rope_parameters["partial_rotary_factor"] = 48 / 64  # where transformers 5's Phi-3 reads it
        elif variant == "longrope":  # the factors and attention factor the writer put in the file
            half = shape.head_dim // 2
            config.rope_parameters.update(rope_type="longrope", long_factor=torch.linspace(1.0, 40.0, half).tolist(),
                                          short_factor=torch.linspace(1.0, 2.0, half).tolist(),
                                          original_max_position_embeddings=256,
                                          attention_factor=math.sqrt(1 + math.log(2) / math.log(256)))
            config.original_max_position_embeddings = 256
        elif variant == "linear-rope":
            config.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
        else:
            config.rope_parameters.update(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)
        rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        rebuilt.load_state_dict(ref.state_dict())
        with torch.inference_mode():
            whole = ref(torch.tensor([IDS])).logits[0]
        ref = rebuilt
    with torch.inference_mode():
        theirs = ref(torch.tensor([IDS])).logits[0]
        mine = ours.logits(IDS)[0]
    assert theirs.abs().max() > 1.0  # random weights of std 0.1: logits that tell positions apart
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if variant and variant != "head-96":  # and the RoPE transformers' reader leaves would have been a different model
        assert (whole - theirs).abs().max() > 0.01
    if variant == "longrope":  # past the original context: the long factors
        long_ids = [(i * 37) % 300 + 5 for i in range(300)]
        with torch.inference_mode():
            torch.testing.assert_close(ours.logits(long_ids)[0], ref(torch.tensor([long_ids])).logits[0],
                                       rtol=1e-4, atol=1e-4)
    # and the file's own blocks (the app's default) pick the same next tokens
    q = load_model(path, device="cpu")
    with torch.inference_mode():
        assert (q.logits(IDS)[0].argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
