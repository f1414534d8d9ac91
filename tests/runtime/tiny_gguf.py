"""Tiny random-weight GGUF files for tests (a helper, not a test file): the "tiny" Llama
shape of :mod:`runtime.weights.gguf_write` (2 layers, hidden 256), a few hundred KB,
written in well under a second."""
from __future__ import annotations

from pathlib import Path

from runtime.weights.gguf_write import LlamaShape, SHAPES, write_random_gguf

#: One matrix kind per block type, so one file holds every quantized type.
EVERY_TYPE = {"attn_q.weight": "Q5_K", "attn_k.weight": "Q4_0", "attn_v.weight": "Q5_0",
              "attn_output.weight": "Q5_1", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0",
              "ffn_down.weight": "Q6_K"}
TINY_VOCAB = 320


def make_tiny_gguf(folder: Path, name: str = "tiny.gguf", *, matrix_type: str = "Q4_K",
                   overrides: dict[str, str] | None = None, embed_type: str | None = None,
                   tokenizer: dict | None = None, seed: int = 0, arch: str = "llama") -> Path:
    """Write ``folder / name``: the tiny shape, every projection ``matrix_type`` unless
    ``overrides`` says otherwise (:data:`EVERY_TYPE` covers all quantized types)."""
    shape = SHAPES["tiny"] if tokenizer else LlamaShape(**{**SHAPES["tiny"].__dict__, "vocab": TINY_VOCAB})
    return write_random_gguf(folder / name, shape, matrix_type=matrix_type, overrides=overrides,
                             embed_type=embed_type, tokenizer=tokenizer, seed=seed, std=0.1, arch=arch)
