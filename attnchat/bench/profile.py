"""``attnchat bench --profile``: where a decoded token's time goes, and prefill's per chunk size.

For our engine only (the peers' insides are not ours to time). Decode, at a depth of 512:

- the app's decode step (``decode_mode``), and in ``"ggml"`` mode its own timers
  (:attr:`runtime.model.ggml_step.GGMLStep.timings`): ggml's graphs (norms, products, RoPE,
  MLP), the KV cache's writes, attention, the LM head, the rest (embedding, RoPE rows,
  Python);
- the eager step (:meth:`runtime.model.decoder.Decoder.forward`), timed, then under ``torch.profiler``:
  aten calls per token and their own CPU time by kind; what no torch operation accounts
  for (ggml's products are ctypes calls, not torch operations; Python) is the step's wall
  time less those.

Prefill: milliseconds per token for a chunk of 16, 64, 256 and 512 tokens on a fresh cache.
Every figure is a median over the tokens (or chunks) timed, in milliseconds.
"""
from __future__ import annotations

import statistics
import time

__all__ = ["profile", "print_profile"]

#: aten operator names -> the kind of work they are (the rest count as "views, copies, casts").
KINDS = {
    "products": ("mm", "addmm", "linear", "bmm", "matmul", "_weight_int4pack_mm", "_weight_int8pack_mm", "mkldnn"),
    "attention": ("scaled_dot_product", "softmax"),
    "norms": ("rms_norm", "layer_norm", "pow", "mean", "rsqrt"),
    "elementwise": ("mul", "add", "sub", "div", "neg", "silu", "gelu", "tanh", "exp", "cat", "where"),
}


def _kind(name: str) -> str:
    op = name.removeprefix("aten::")
    for kind, words in KINDS.items():
        if any(op == w or op.startswith(w + "_") or w in op and kind != "elementwise" for w in words):
            return kind
    return "views, copies, casts"


def profile(model, *, depth: int = 512, tokens: int = 16, seed: int = 0) -> dict:
    """The profile of ``model`` (a :class:`runtime.loader.model.Model`): see the module's docstring."""
    import random

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    limit = model.config.max_position_embeddings
    depth = max(1, min(depth, limit - 3 * tokens - 1))  # a small model's context may be shorter
    rng = random.Random(seed)
    special = set(model.tokenizer.all_special_ids)
    vocab = [t for t in range(model.config.vocab_size) if t not in special]
    ids = [rng.choice(vocab) for _ in range(max(depth + 3 * tokens, min(512, limit - 1)))]
    out: dict = {"decode_mode": model.decode_mode, "depth": depth}
    with torch.inference_mode():
        cache = model.new_cache(depth + 3 * tokens + 1)
        model.logits(ids[:depth], cache, last_only=True)
        step = model._decode_step()
        ggml = step._ggml_step() if model.decode_mode == "ggml" else None
        walls = []
        if ggml is not None:
            ggml.timings = {}
        try:
            for t in ids[depth:depth + tokens]:
                t0 = time.perf_counter()
                model.decode_next(t, cache)
                walls.append(time.perf_counter() - t0)
        finally:
            parts = ggml.timings if ggml is not None else None
            if ggml is not None:
                ggml.timings = None
        out["step_ms"] = statistics.median(walls) * 1e3
        if parts:
            out["step_parts_ms"] = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        eager = []
        for t in ids[depth + tokens:depth + 2 * tokens]:   # timed without the profiler's own overhead
            t0 = time.perf_counter()
            model.decoder(torch.tensor([[t]]), cache, last_only=True)
            eager.append(time.perf_counter() - t0)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for t in ids[depth + 2 * tokens:depth + 3 * tokens]:
                model.decoder(torch.tensor([[t]]), cache, last_only=True)
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        kinds: dict[str, float] = {}
        for e in events:
            kinds[_kind(e.key)] = kinds.get(_kind(e.key), 0.0) + e.self_cpu_time_total / 1e3 / tokens
        wall = statistics.median(eager) * 1e3
        out["eager"] = {"step_ms": wall, "aten_calls_per_token": sum(e.count for e in events) / tokens,
                        "aten_ms_by_kind": kinds, "not_torch_ms": max(0.0, wall - sum(kinds.values()))}
        chunks = {}
        for size in [s for s in (16, 64, 256, 512) if s < min(limit, len(ids))]:
            c = model.new_cache(size + 1)
            t0 = time.perf_counter()
            model.logits(ids[:size], c, last_only=True)
            chunks[str(size)] = (time.perf_counter() - t0) / size * 1e3
        out["prefill_ms_per_token"] = chunks
    return out


def print_profile(engine: str, p: dict) -> None:
    """The profile as a few lines of text (stdout)."""
    print(f"profile, {engine} (decode at depth {p['depth']}, ms per token, medians):")
    line = f"  {p['decode_mode']} step {p['step_ms']:.2f}"
    if p.get("step_parts_ms"):
        line += ": " + ", ".join(f"{k} {v:.2f}" for k, v in p["step_parts_ms"].items())
    print(line)
    e = p["eager"]
    print(f"  eager step {e['step_ms']:.2f}: {e['aten_calls_per_token']:.0f} aten calls, "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(e["aten_ms_by_kind"].items(), key=lambda kv: -kv[1]))
          + f", not torch (ggml products, Python) {e['not_torch_ms']:.2f}")
    print("  prefill ms per token by chunk: " + ", ".join(f"{k}: {v:.2f}" for k, v in p["prefill_ms_per_token"].items()))
