"""Tiny random-weight GGUF files for tests (a helper, not a test file): the "tiny" Llama
shape of :mod:`runtime.weights.gguf.write` (2 layers, hidden 256), a few hundred KB,
written in well under a second."""
from __future__ import annotations

from pathlib import Path

from runtime.weights.gguf.write import LlamaShape, SHAPES, write_random_gguf

#: One matrix kind per block type, so one file holds every quantized type.
EVERY_TYPE = {"attn_q.weight": "Q5_K", "attn_k.weight": "Q4_0", "attn_v.weight": "Q5_0",
              "attn_output.weight": "Q5_1", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0",
              "ffn_down.weight": "Q6_K"}
#: The types that run only through ggml's kernels (or widened), in two files of one type per
#: matrix kind: ``(overrides, embedding type)`` each.
GGML_ONLY_TYPES = (
    ({"attn_q.weight": "Q2_K", "attn_k.weight": "Q3_K", "attn_v.weight": "IQ2_XXS", "attn_output.weight": "IQ2_XS",
      "ffn_gate.weight": "IQ3_XXS", "ffn_up.weight": "IQ1_S", "ffn_down.weight": "IQ4_NL"}, "IQ3_S"),
    ({"attn_q.weight": "IQ2_S", "attn_k.weight": "IQ4_XS", "attn_v.weight": "IQ1_M", "attn_output.weight": "TQ1_0",
      "ffn_gate.weight": "TQ2_0", "ffn_up.weight": "MXFP4", "ffn_down.weight": "NVFP4"}, "Q1_0"),
)
TINY_VOCAB = 320


def make_tiny_gguf(folder: Path, name: str = "tiny.gguf", *, matrix_type: str = "Q4_K",
                   overrides: dict[str, str] | None = None, embed_type: str | None = None,
                   tokenizer: dict | None = None, seed: int = 0, arch: str = "llama", window: int = 512) -> Path:
    """Write ``folder / name``: the tiny shape, every projection ``matrix_type`` unless
    ``overrides`` says otherwise (:data:`EVERY_TYPE` covers all quantized types)."""
    shape = SHAPES["tiny"] if tokenizer else LlamaShape(**{**SHAPES["tiny"].__dict__, "vocab": TINY_VOCAB})
    return write_random_gguf(folder / name, shape, matrix_type=matrix_type, overrides=overrides,
                             embed_type=embed_type, tokenizer=tokenizer, seed=seed, std=0.1, arch=arch,
                             window=window)


def tiny_tokenizer_metadata() -> dict:
    """GGUF ``tokenizer.*`` metadata of :func:`tests.runtime.tiny_models.make_tokenizer`'s byte-level
    BPE (320 tokens, its merges, the special tokens as control tokens, its chat template)."""
    import json

    import numpy as np

    from tests.runtime.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS, make_tokenizer

    tok = make_tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = np.array([3 if t in SPECIAL_TOKENS else 1 for t in tokens], dtype="<i4")
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"], "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
            "tokenizer.ggml.unknown_token_id": vocab["[UNK]"], "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
            "tokenizer.chat_template": CHAT_TEMPLATE}
