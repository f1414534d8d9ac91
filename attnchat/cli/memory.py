"""``attnchat memory``: the memory planner on the command line.

``attnchat memory [--model SRC | --layers N --kv-heads N --head-dim N] [--cache-dtype D]
--context N [--budget-mib M] [--cache-policy P --cache-budget N] [--device D] [--json]``

Under a cache policy the cache holds at most its budget per full-attention layer (the same
ceiling the chat keeps), and the plan counts that.

The plan is for ``--device``'s defaults (its weights' dtype, and the cache in the dtype it
computes in: float32 on the CPU, float16 on CUDA and MPS) even on a machine without that
device: one line says so, and there is no free memory to report then.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from attnchat import cache_options, model_options

from models.kv_bytes import UNBOUNDED

MIB = 1024 * 1024
#: Longer contexts are refused: no model reads that far (the longest claim 10 million tokens).
MAX_CONTEXT = 1_000_000_000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory", help="plan weights and KV-cache memory",
        description="Weights bytes, KV bytes per token and at a context, and the longest context that fits a budget. "
                    "Give a model, or its shape as numbers (to check a model before fetching it).")
    p.add_argument("--model", metavar="SRC", help="a .gguf file or a model folder (default: the default model)")
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers (with --kv-heads and --head-dim)")
    p.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads per layer")
    p.add_argument("--head-dim", type=int, metavar="N", help="dimensions per head")
    model_options.add_cache_dtype_arg(p)
    p.add_argument("--weights-dtype", default=None, metavar="D", help="weights' dtype for weights_bytes (default: a quantized GGUF's own blocks at their size, "
                   "else the device's default, float16)")
    p.add_argument("--context", type=int, default=None, metavar="N", help="context length in tokens (default: the model's maximum)")
    p.add_argument("--budget-mib", type=float, default=None, metavar="M", help="a KV-cache budget in MiB")
    p.add_argument("--device", default="cpu",
                   help="the device planned for, and whose free memory to report: cpu, cuda, cuda:N, mps, auto")
    cache_options.add_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from runtime.memory.planner import plan, plan_for_config

    device, missing = _device(args.device)
    if args.context is not None and args.context > MAX_CONTEXT:
        raise ValueError(f"--context {args.context:,} is past any model's reach; give at most {MAX_CONTEXT:,} tokens")
    numbers = [args.layers, args.kv_heads, args.head_dim]
    if any(n is not None for n in numbers) and args.model:
        raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
    kept = cache_options.settings(args)
    policy = dict(cache_budget=kept["cache_budget"], cache_budget_bytes=kept["cache_budget_bytes"])
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
                      cache_dtype=args.cache_dtype, context=args.context, budget_bytes=budget, device=device,
                      weights_dtype=args.weights_dtype, **policy)
        name, limit = None, None
    else:
        from runtime.loader.load import gguf_blocks_bytes, read_config

        cfg = read_config(args.model)
        context = args.context if args.context is not None else cfg.max_position_embeddings
        blocks = gguf_blocks_bytes(args.model)
        cache_dtype = args.cache_dtype
        if cache_dtype is None and blocks is not None and args.weights_dtype is None:
            from runtime import cache_dtype_for   # the cache the load will give it (timed per machine)

            cache_dtype = cache_dtype_for(device, "float16", blocks=True, head_dim=cfg.head_dim)
        result = plan_for_config(cfg, cache_dtype=cache_dtype, context=context, budget_bytes=budget,
                                 weights_dtype=args.weights_dtype, device=device, blocks=blocks, **policy)
        name, limit = args.model or "default", cfg.max_position_embeddings
    if missing:  # whatever torch answered, this machine has no such device to measure
        result = dataclasses.replace(result, free_device_bytes=None, fits_device=None)
    out = result.to_dict()
    out.update(model=name, model_context=limit, device_here=not missing)
    if args.json:
        print(json.dumps(out))
        return 0
    def past(n: int) -> str:  # a context the model does not read
        return f" (the model stops at {limit:,})" if limit and n > limit else ""

    rows = [
        ("model", name or f"{result.layers} layers x {_heads(result.kv_heads)} x {result.head_dim}"),
        ("device", f"{result.device}" + (f": {missing}; planned for its defaults, free memory unknown" if missing else "")),
        ("KV bytes per token", f"{result.kv_bytes_per_token:,} ({result.cache_dtype})"),
        (f"KV bytes at {result.context:,} tokens",
         f"{result.kv_bytes:,} ({result.kv_bytes / MIB:,.1f} MiB){past(result.context)}"
         + (f"; {args.cache_policy} keeps at most {result.cache_budget:,} tokens per layer"
            if result.cache_budget is not None else "")),
    ]
    if any(t["kind"] == "sliding" for t in result.layer_types):
        for t in result.layer_types:
            what = "full-attention layers" if t["window"] is None else f"sliding layers (window {t['window']:,})"
            rows.append((f"  {t['layers']} {what}",
                         f"{t['bytes_per_token']:,} B per token, {t['tokens']:,} tokens each: {t['used_bytes']:,} B "
                         f"({t['used_bytes'] / MIB:,.1f} MiB)"))
    for v in result.variants:
        label = v["name"] + (f" ({_heads(v['kv_heads'])}" + (f", window {v['window']:,} on {v['windowed_layers']} layers)" if v["window"] else ")"))
        mark = "  <- this model" if v["this_model"] else ""
        rows.append((f"  {label}", f"{v['bytes_per_token']:,} B per token, {v['bytes_at_context'] / MIB:,.1f} MiB at {result.context:,}{mark}"))
    if result.weights_bytes is not None:
        rows.append(("weights bytes", f"{result.weights_bytes:,} ({result.weights_bytes / MIB:,.1f} MiB, {result.weights_dtype})"))
    if result.total_bytes is not None:
        rows.append(("tokenizer (at most)", f"{result.tokenizer_bytes / MIB:,.1f} MiB"))
        rows.append(("a reply's peak", f"{result.turn_bytes / MIB:,.1f} MiB (a prefill chunk's activations, the logits)"))
        rows.append((f"total at {result.context:,} tokens", f"{result.total_bytes / MIB:,.1f} MiB; leaves out "
                     + "; ".join(result.leaves_out)))
    if result.max_context_in_budget is not None:
        rows.append((f"longest context in {args.budget_mib:g} MiB",
                     "any length (no layer grows past it)" if result.max_context_in_budget >= UNBOUNDED else
                     f"{result.max_context_in_budget:,} tokens{past(result.max_context_in_budget)}"))
    if result.free_device_bytes is not None:
        rows.append((f"free memory on {result.device}", f"{result.free_device_bytes / MIB:,.0f} MiB"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _heads(n: int) -> str:
    return f"{n} KV head" + ("" if n == 1 else "s")


def _device(name: str) -> tuple[str, str | None]:
    """(the device to plan for, why this machine cannot measure it or ``None``).

    ``auto`` is this machine's choice. A CUDA or MPS device this machine lacks is still
    planned for (its defaults are known); an unknown name is a :class:`DeviceError`."""
    import torch

    from runtime.device import resolve_device
    from runtime.errors import DeviceError

    try:
        return str(resolve_device(name)), None
    except DeviceError as e:
        try:
            dev = torch.device(name.lower())
        except RuntimeError:
            raise e from None
        if dev.type not in ("cuda", "mps"):
            raise
        if dev.type == "cuda" and torch.cuda.is_available():
            why = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
        else:
            why = "no CUDA here" if dev.type == "cuda" else "no Apple MPS here"
        return str(dev), f"not on this machine ({why})"
