"""``attnchat heads``: every head's induction and previous-token score (Olsson et al. 2022).

``attnchat heads [--model SRC] [--repeat-len N] [--batch B] [--seed S] [--json]``
prints ``{"induction": [[...]], "previous_token": [[...]]}``, layers x heads, zero-based.
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "heads", help="score every attention head (induction, previous-token)",
        description="Run the standard probe (random tokens repeated twice) and score every head.")
    p.add_argument("--model", metavar="SRC", help="a .gguf file or a model folder (default: the default model)")
    p.add_argument("--repeat-len", type=int, default=50, metavar="N", help="length of each random copy (default 50)")
    p.add_argument("--batch", type=int, default=4, metavar="B", help="random sequences averaged (default 4)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.repeat_len < 2 or args.batch < 1:
        raise ValueError("--repeat-len must be at least 2 and --batch at least 1")
    from attnchat.fetching import model_source
    from runtime import load_model
    from runtime.insight.probe import head_scores

    model = load_model(model_source(args.model), device=args.device)
    if 1 + 2 * args.repeat_len > model.config.max_position_embeddings:
        raise ValueError(f"--repeat-len {args.repeat_len} needs more than the model's {model.config.max_position_embeddings} positions")
    scores = head_scores(model, repeat_len=args.repeat_len, batch=args.batch, seed=args.seed)
    if args.json:
        print(json.dumps(scores.to_dict()))
        return 0
    for kind in ("induction", "previous_token"):
        print(f"top {kind.replace('_', '-')} heads (layer.head: score):")
        for layer, head, s in scores.top(kind, 8):
            print(f"  L{layer}.H{head}: {s:.3f}")
    return 0
