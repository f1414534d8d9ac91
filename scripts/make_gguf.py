"""Write a random-weight GGUF of a real model's shape, for the benchmark.

    .venv/bin/python scripts/make_gguf.py OUT.gguf [--shape llama-3.2-1b|qwen3-8b|...] [--type Q4_K|Q4_0|...]
        [--embed-type Q6_K] [--tokenizer FILE.gguf] [--seed 0]

Default: Llama 3.2 1B's shape (16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads)
with the default model's tokenizer (49,152 tokens, so the tied embedding is 49,152 x
2048), every projection in ``--type``, the embedding in Q6_K for K-quants and Q8_0
otherwise. ``--shape`` may also name a released model of another family
(``runtime.weights.gguf.write.REAL_SHAPES``: Qwen2.5, Qwen3, Gemma 3, Phi ...), written with
that family's tensors and metadata keys and the tokenizer's vocabulary. The weights are
noise: the file is for memory and speed, not for text.
``attnchat bench --model OUT.gguf`` runs it against llama.cpp.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from runtime.weights.gguf.write import REAL_SHAPES, SHAPES, tokenizer_metadata, write_random_gguf
from runtime.weights.quant_types import BLOCK_TYPES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(set(SHAPES) | set(REAL_SHAPES)))
    ap.add_argument("--type", default="Q4_K", choices=[n for n, t in BLOCK_TYPES.items() if t.quantized] + ["F16"])
    ap.add_argument("--embed-type", choices=list(BLOCK_TYPES))
    ap.add_argument("--tokenizer", type=Path, help="copy the tokenizer of this GGUF (default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    src = args.tokenizer
    if src is None:
        from models import fetch

        src = fetch.ensure_default()
    t0 = time.perf_counter()
    tok = tokenizer_metadata(src)
    arch, shape = "llama", args.shape
    if args.shape not in SHAPES:  # a released model's shape, with the tokenizer's vocabulary
        arch, shape, _title = REAL_SHAPES[args.shape]
        shape = replace(shape, vocab=None)
    path = write_random_gguf(args.out, shape, matrix_type=args.type, embed_type=args.embed_type, tokenizer=tok,
                             name=f"random {args.shape} {args.type}", seed=args.seed, arch=arch)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, {args.shape} in {args.type}, tokenizer of {Path(src).name} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
