"""What the attention view's live capture costs a decode step: a short profile.

``python -m attnchat.bench.capture_cost [--model SRC] [--depth 512] [--steps 32] [--device cpu]``

Decodes ``--steps`` tokens after a ``--depth``-token prefill, alternating (A B A B)
between the decoder's ``observer`` unset (the panel closed: the default) and set to a
``runtime.AttentionCapture(last_row_only=True)`` (the Live tab on screen), and prints
the median step time of each and, from ``torch.profiler``, the operators one step runs
in each mode. Closed, a step runs exactly the fast path's operators: the only extra
work is one ``observer is not None`` test per layer, timed here on its own.
Measured, not asserted: speed belongs in the benchmark, not in unit tests.
"""
from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections import Counter

import torch

from runtime import AttentionCapture, load_model


def _step(model, cache, token: int) -> float:
    t = time.perf_counter()
    model.logits([token], cache, last_only=True)
    return time.perf_counter() - t


def _ops(model, cache, token: int) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model.logits([token], cache, last_only=True)
    return Counter({e.key: e.count for e in prof.key_averages()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnchat.bench.capture_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--depth", type=int, default=512, help="tokens in the cache before decoding")
    p.add_argument("--steps", type=int, default=32, help="decode steps per mode")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    model = load_model(a.model, device=a.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (a.depth + 2 * a.steps + 8,), generator=g).tolist()
    cache = model.new_cache(len(ids) + 8)
    model.logits(ids[: a.depth], cache, last_only=True)
    times: dict[str, list[float]] = {"closed": [], "open": []}
    for i in range(4):  # warm-up, both modes
        with AttentionCapture(model, last_row_only=True):
            _step(model, cache, ids[a.depth + i])
        _step(model, cache, ids[a.depth + i])
    pos = a.depth + 4
    for _ in range(a.steps):
        times["closed"].append(_step(model, cache, ids[pos]))
        with AttentionCapture(model, last_row_only=True):
            times["open"].append(_step(model, cache, ids[pos + 1]))
        pos += 2
    closed_ops = _ops(model, cache, ids[pos])
    with AttentionCapture(model, last_row_only=True):
        open_ops = _ops(model, cache, ids[pos + 1])
    d = model.decoder
    n = model.config.n_layers
    check_s = timeit.timeit(lambda: [d.observer is not None for _ in range(n)], number=2000) / 2000
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {model.name}, device {model.device}, {n} layers, depth {a.depth}..{cache.length} tokens, "
          f"{a.steps} steps per mode, torch threads {torch.get_num_threads()}")
    for k in ("closed", "open"):
        v = times[k]
        print(f"  {k:6s} (observer {'unset' if k == 'closed' else 'set'}): median {med[k] * 1e3:7.2f} ms/token "
              f"(min {min(v) * 1e3:.2f}, max {max(v) * 1e3:.2f})")
    print(f"  open / closed: {med['open'] / med['closed']:.2f}x")
    print(f"  the closed-panel check, {n} x `observer is not None`: {check_s * 1e6:.2f} us per token "
          f"({check_s / med['closed'] * 100:.4f} % of a step)")
    keys = ("aten::scaled_dot_product_attention", "aten::softmax", "aten::repeat_interleave", "aten::masked_fill",
            "aten::matmul", "aten::to", "aten::copy_")
    print("  operators in one step       closed   open")
    for k in keys:
        print(f"    {k:34s} {closed_ops.get(k, 0):5d} {open_ops.get(k, 0):6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
