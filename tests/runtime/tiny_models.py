"""Tiny seeded random models of each supported family, saved in transformers' layout.

A helper for tests (not a test file). ``make_tiny_model(tmp_dir, family)`` writes
``config.json``, ``model.safetensors`` and a small byte-level BPE tokenizer with a chat
template into ``tmp_dir / family`` and returns that folder. The weights come from
``torch.manual_seed(0)``, so every call builds the same model: each distinct model is built
once per test process and copied into each caller's folder (building one through transformers
costs ~0.3 s, copying its few files ~1 ms), so a test may change its copy freely.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
#: More families, each with its own piece: Llama 3.1's RoPE scaling,
#: Qwen3's q/k norms, Gemma 2 (soft-capping, alternating sliding layers), Gemma 3
#: (multi-query, 2 sliding + 1 global layer with their own RoPE bases), Phi-3 (fused
#: q/k/v and gate/up, partial rotary), Mistral and Qwen2 with a sliding window.
MORE_FAMILIES = ("llama3", "qwen3", "gemma2", "gemma3", "phi3", "mistral-window", "qwen2-window", "granite", "olmo2",
                 "smollm3")
#: The sliding window of the tiny windowed models (tokens): shorter than the test inputs.
WINDOW = 8

#: 64 plain words: the BPE tokenizer's training text.
WORDS = (
    "the a an and or but if then is are was were be been have has had do does did "
    "i you he she it we they me him her us them my your his its our their what "
    "which who when where why how all each few more most other some such no not "
    "only own same so than too very can will"
).split()
SPECIAL_TOKENS = ("[UNK]", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
#: 4 special tokens + 256 byte tokens + merges learnt from :data:`WORDS`.
VOCAB_SIZE = 320

#: Std of the random init (transformers' default is 0.02).
INIT_STD = 0.1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: SmolLM2-135M-Instruct's template, as its GGUF carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer():
    """A transformers fast tokenizer: byte-level BPE, :data:`VOCAB_SIZE` tokens.

    Byte-level (as GPT-2, Llama 3, Qwen2 and SmolLM use) so any text encodes and so
    transformers' ``Qwen2Tokenizer`` (which AutoTokenizer picks for every ``qwen2``
    folder and which rebuilds a byte-level BPE from the saved vocab and merges) reads
    it back as the same tokenizer. Trained on :data:`WORDS`: 60 merges, the rest of
    any text falls back to single bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    assert len(set(WORDS)) == len(WORDS) == 64, "the word list must hold 64 distinct words"
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    backend.train_from_iterator(corpus, trainer)
    assert backend.get_vocab_size() == VOCAB_SIZE, backend.get_vocab_size()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(family: str, vocab_size: int, eos_id: int, bos_id: int, max_positions: int = 128):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    # GQA: 4 query heads share 2 KV heads; head_dim 16; 2 layers.
    llama_like = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        # Larger than the default 0.02 so logits are O(1) and attention is not uniform:
        # a small error in our decoder then shows up against the 1e-4 tolerance.
        initializer_range=INIT_STD,
    )
    if family == "llama":
        return LlamaConfig(**llama_like)
    if family == "mistral":
        return MistralConfig(**llama_like, sliding_window=None)
    if family == "qwen2":
        # Tied embeddings here, so the tied-head path is tested too.
        return Qwen2Config(**{**llama_like, "tie_word_embeddings": True}, use_sliding_window=False)
    if family in MORE_FAMILIES:
        return _more_config(family, llama_like)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=max_positions,
            bos_token_id=bos_id, eos_token_id=eos_id,
            # Dropout off (eval mode does this anyway; explicit for clarity).
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=INIT_STD,
        )
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def _more_config(family: str, llama_like: dict):
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, Olmo2Config,
                              Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config)

    base = {k: v for k, v in llama_like.items() if k != "rope_theta"}
    if family == "llama3":
        return LlamaConfig(**base, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        })
    if family == "qwen3":
        return Qwen3Config(**llama_like, use_sliding_window=False)
    if family == "gemma2":
        return Gemma2Config(**{**llama_like, "tie_word_embeddings": True}, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")
    if family == "gemma3":
        # Multi-query (1 KV head), as Gemma 3 270M; the global layer's RoPE is scaled (linear, as Gemma 3 4B+).
        return Gemma3TextConfig(**{**base, "num_key_value_heads": 1, "num_hidden_layers": 3, "tie_word_embeddings": True},
                                sliding_window=WINDOW, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})
    if family == "phi3":
        return Phi3Config(**{**base, "num_key_value_heads": 4}, partial_rotary_factor=0.5, sliding_window=WINDOW * 2,
                          original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0]})
    if family == "mistral-window":
        return MistralConfig(**llama_like, sliding_window=WINDOW)
    if family == "qwen2-window":
        return Qwen2Config(**llama_like, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "granite":   # Granite 3.3 2B's multipliers (its attention scale: 1 / 64 for heads of 64)
        return GraniteConfig(**llama_like, embedding_multiplier=12.0, attention_multiplier=0.015625,
                             residual_multiplier=0.22, logits_scaling=8.0)
    if family == "olmo2":
        return Olmo2Config(**llama_like)
    if family == "smollm3":   # four layers: the fourth has no RoPE
        return SmolLM3Config(**{**llama_like, "num_hidden_layers": 4})
    raise ValueError(family)


def make_tiny_model(tmp_dir, family: str, *, max_positions: int = 128, overrides: dict | None = None) -> Path:
    """Build a tiny seeded random ``family`` model and save it to ``tmp_dir / family``.

    Args:
        tmp_dir: a folder (e.g. pytest's ``tmp_path``); the model goes in a subfolder.
        family: one of :data:`FAMILIES` or :data:`MORE_FAMILIES`.
        max_positions: the model's maximum context (tokens).
        overrides: config attributes set before the model is built (e.g. Gemma 3's
            ``layer_types``).

    Returns:
        The folder: config.json, model.safetensors and tokenizer files.
    """
    import torch

    key = repr((family, max_positions, sorted((overrides or {}).items())))
    if key not in _BUILT:
        folder = _build(_built_dir() / str(len(_BUILT)), family, max_positions, overrides)
        _BUILT[key] = folder, torch.get_rng_state()
    folder, rng = _BUILT[key]
    torch.set_rng_state(rng)  # torch's generator as a build leaves it: draws after a call stay the same
    out = Path(tmp_dir) / family
    shutil.copytree(folder, out, copy_function=shutil.copy, dirs_exist_ok=True)  # fresh mtimes, as a save
    return out


#: Model key -> its folder, built once in this process (:func:`make_tiny_model` copies it), and
#: torch's generator state after the build.
_BUILT: dict[str, tuple[Path, object]] = {}
_ROOT: list[Path] = []


def _built_dir() -> Path:
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="attnchat-tiny-models-")))
        atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
    return _ROOT[0]


def _build(tmp_dir: Path, family: str, max_positions: int, overrides: dict | None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    cfg = _config(family, len(tok), tok.eos_token_id, tok.bos_token_id, max_positions)
    for name, value in (overrides or {}).items():
        setattr(cfg, name, value)
    assert cfg.vocab_size == len(tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        # Random init leaves norm weights at 1 and (in transformers) biases at 0; give
        # them random values so a swapped or dropped norm weight or bias changes the logits.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
        if family == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    assert proj.bias is not None, "Qwen2 has q/k/v biases"
                    proj.bias.copy_(torch.randn_like(proj.bias))
    out = Path(tmp_dir) / family
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out
