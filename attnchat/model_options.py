"""The options that choose a model and how it runs, as ``attnchat chat`` (and ``--terminal``) and
``attnchat serve`` both take them: one wording for both. No torch at import.
"""
from __future__ import annotations

import argparse

MODEL_HELP = ("a .gguf file, a model folder, a catalog id or hf.co/OWNER/REPO:QUANT "
              "(fetched first when missing; default: the default model)")


#: --cache-dtype's help, as chat, serve and memory take it (runtime.cache_dtype_for).
CACHE_DTYPE_HELP = ("KV-cache dtype: float32, bfloat16, float16, int8 (8-bit, a scale per token and head); default: "
                    "for a GGUF run from its own blocks on the CPU (the default model) float16, or bfloat16 or "
                    "float32 where this machine reads it much faster at the model's head size (timed once), else "
                    "the dtype the model computes in (float32 on the CPU)")


def add_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--cache-dtype D`` (a dtype name, or None for the default)."""
    p.add_argument("--cache-dtype", default=None, metavar="D", help=CACHE_DTYPE_HELP)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model SRC``."""
    p.add_argument("--model", metavar="SRC", help=MODEL_HELP)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--reproducible``."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default=None, help="weights: a quantized GGUF runs from its own blocks by default (gguf); float32, bfloat16, "
                   "float16, int8 widen them for comparison (the default for other models: float16, computing in float32 on the CPU)")
    p.add_argument("--reproducible", action="store_true",
                   help="the same greedy reply however a conversation's tokens were computed (one prefill, chunks, "
                        "one-token steps, a reused cache) and on any thread count: row-invariant kernels and attention "
                        "(CPU, eager decode; slower, and float16 weights keep a packed copy; a quantized GGUF runs "
                        "widened to float16; docs/reproducible.md)")
