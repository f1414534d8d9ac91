"""``attnchat formula``: the attention formula by hand, each step printed.

``attnchat formula --q 2,0 --k 0,1 2,0 1,1 --v 1,0 0,1 1,1 [--no-scale] [--causal-at 1] [--json]``
prints the scores ``q·k``, the scaled scores (``/ sqrt(d_k)``), the softmax weights
(masked keys: 0) and the output ``sum_j w_j v_j``; with ``--json``, one object with the
keys ``scores``, ``scaled``, ``weights``, ``output`` (and ``masked``, ``scale``, ``d_k``).
Defaults: the material's worked example, "the cat sat".
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

#: The material's three tokens "the cat sat" (their keys and values) and the query of "sat".
EXAMPLE_TOKENS = ("the", "cat", "sat")
EXAMPLE_Q = "2,0"
EXAMPLE_K = ("0,1", "2,0", "1,1")
EXAMPLE_V = ("1,0", "0,1", "1,1")


def parse_vector(text: str, what: str) -> list[float]:
    """``"2,0"`` -> ``[2.0, 0.0]``.

    Raises:
        ValueError: not comma-separated finite numbers (the message names ``what``).
    """
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a vector; write numbers separated by commas, e.g. 1,0") from None
    if not all(math.isfinite(x) for x in out):
        raise ValueError(f"{what} {text!r} holds a number that is not finite; use ordinary numbers")
    return out


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "formula", help="compute softmax(q·k/sqrt(d_k))·v by hand, step by step",
        description="One query against a few keys and values: scores, scaled scores, weights, output. "
                    "Defaults: the worked example 'the cat sat' (K = (0,1), (2,0), (1,1); V = (1,0), (0,1), (1,1); q = (2,0)).")
    p.add_argument("--q", default=EXAMPLE_Q, metavar="Q", help="the query, numbers separated by commas (default 2,0)")
    p.add_argument("--k", nargs="+", default=list(EXAMPLE_K), metavar="K", help="one key per token (default 0,1 2,0 1,1)")
    p.add_argument("--v", nargs="+", default=list(EXAMPLE_V), metavar="V", help="one value per token (default 1,0 0,1 1,1)")
    p.add_argument("--no-scale", action="store_true", help="do not divide the scores by sqrt(d_k)")
    p.add_argument("--causal-at", type=int, default=None, metavar="I",
                   help="the query's own position (zero-based): keys after it are masked, weight 0")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _vec(xs: list[float]) -> str:
    return "(" + ", ".join(f"{x:.3f}" for x in xs) + ")"


def run(args: argparse.Namespace) -> int:
    q = parse_vector(args.q, "--q")
    keys = [parse_vector(k, "--k") for k in args.k]
    values = [parse_vector(v, "--v") for v in args.v]
    from runtime.insight.formula import formula_by_hand

    r = formula_by_hand(q, keys, values, scale=not args.no_scale, causal_at=args.causal_at)
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    div = f"/√{r.d_k}" if not args.no_scale else "(no scale)"
    # the worked example's rows are its tokens (the README and --help name it "the cat sat")
    example = tuple(args.k) == EXAMPLE_K and tuple(args.v) == EXAMPLE_V
    names = EXAMPLE_TOKENS if example else tuple(str(j) for j in range(len(keys)))
    whose = ' (the query of "sat" in the worked example "the cat sat")' if example and args.q == EXAMPLE_Q else ""
    print(f"q = {_vec(q)}{whose}, d_k = {r.d_k}, scale = {r.scale:.3f}")
    width = max(3, *(len(n) for n in names))
    print(f"{'key':>{width}}  {'k':>16}  {'v':>16}  {'q·k':>8}  {div:>10}  {'weight':>7}")
    for j, (k, v) in enumerate(zip(keys, values)):
        w = "masked" if r.masked[j] else f"{r.weights[j]:.3f}"
        print(f"{names[j]:>{width}}  {_vec(k):>16}  {_vec(v):>16}  {r.scores[j]:>8.3f}  {r.scaled[j]:>10.3f}  {w:>7}")
    print(f"output = {_vec(r.output)}")
    return 0
