"""``attnchat memory``: the memory planner on the command line.

``attnchat memory [--model SRC | --layers N --kv-heads N --head-dim N] --cache-dtype D
--context N [--budget-mib M] [--device D] [--json]``
"""
from __future__ import annotations

import argparse
import json
from typing import Any

MIB = 1024 * 1024


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory", help="plan weights and KV-cache memory",
        description="Weights bytes, KV bytes per token and at a context, and the longest context that fits a budget. "
                    "Give a model, or its shape as numbers (to check a model before fetching it).")
    p.add_argument("--model", metavar="SRC", help="a .gguf file or a model folder (default: the default model)")
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers (with --kv-heads and --head-dim)")
    p.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads per layer")
    p.add_argument("--head-dim", type=int, metavar="N", help="dimensions per head")
    p.add_argument("--cache-dtype", default="float32", metavar="D", help="float32, bfloat16, float16 or int8 (default float32)")
    p.add_argument("--weights-dtype", default=None, metavar="D", help="weights' dtype for weights_bytes (default: the device's default, float16 on the CPU)")
    p.add_argument("--context", type=int, default=None, metavar="N", help="context length in tokens (default: the model's maximum)")
    p.add_argument("--budget-mib", type=float, default=None, metavar="M", help="a KV-cache budget in MiB")
    p.add_argument("--device", default="cpu", help="whose free memory to report: cpu, cuda, cuda:N, mps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from runtime.memory import plan, plan_for_config

    numbers = [args.layers, args.kv_heads, args.head_dim]
    if any(n is not None for n in numbers) and args.model:
        raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
    budget = None
    if args.budget_mib is not None:
        if args.budget_mib < 0:
            raise ValueError(f"--budget-mib must not be negative; got {args.budget_mib}")
        budget = int(args.budget_mib * MIB)
    if any(n is not None for n in numbers):
        if any(n is None for n in numbers):
            raise ValueError("--layers, --kv-heads and --head-dim go together: give all three")
        if args.context is None:
            raise ValueError("with a model given as numbers, --context is needed")
        result = plan(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      cache_dtype=args.cache_dtype, context=args.context, budget_bytes=budget, device=args.device)
        name = None
    else:
        from runtime.loader import read_config

        cfg = read_config(args.model)
        context = args.context if args.context is not None else cfg.max_position_embeddings
        result = plan_for_config(cfg, cache_dtype=args.cache_dtype, context=context, budget_bytes=budget,
                                 weights_dtype=args.weights_dtype, device=args.device)
        name = args.model or "default"
    out = result.to_dict()
    out["model"] = name
    if args.json:
        print(json.dumps(out))
        return 0
    rows = [
        ("model", name or f"{result.layers} layers x {result.kv_heads} KV heads x {result.head_dim}"),
        ("KV bytes per token", f"{result.kv_bytes_per_token:,} ({result.cache_dtype})"),
        (f"KV bytes at {result.context:,} tokens", f"{result.kv_bytes:,} ({result.kv_bytes / MIB:,.1f} MiB)"),
    ]
    if any(t["kind"] == "sliding" for t in result.layer_types):
        for t in result.layer_types:
            what = "full-attention layers" if t["window"] is None else f"sliding layers (window {t['window']:,})"
            rows.append((f"  {t['layers']} {what}",
                         f"{t['bytes_per_token']:,} B per token, {t['tokens']:,} tokens each: {t['used_bytes']:,} B "
                         f"({t['used_bytes'] / MIB:,.1f} MiB)"))
    for v in result.variants:
        label = v["name"] + (f" ({v['kv_heads']} KV heads" + (f", window {v['window']:,} on {v['windowed_layers']} layers)" if v["window"] else ")"))
        mark = "  <- this model" if v["this_model"] else ""
        rows.append((f"  {label}", f"{v['bytes_per_token']:,} B per token, {v['bytes_at_context'] / MIB:,.1f} MiB at {result.context:,}{mark}"))
    if result.weights_bytes is not None:
        rows.append(("weights bytes", f"{result.weights_bytes:,} ({result.weights_bytes / MIB:,.1f} MiB, {result.weights_dtype})"))
    if result.max_context_in_budget is not None:
        rows.append((f"longest context in {args.budget_mib:g} MiB", f"{result.max_context_in_budget:,} tokens"))
    if result.free_device_bytes is not None:
        rows.append((f"free memory on {result.device}", f"{result.free_device_bytes / MIB:,.0f} MiB"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
