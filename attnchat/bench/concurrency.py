"""``attnchat bench --concurrency 1,2,4,8``: the batching engine at several numbers of requests.

Each level runs in its own process (its peak RSS is its own), in the same run, on the same
prompts: after one short warm-up reply, N requests of ``--prefill-tokens`` prompt tokens (the
same text per request index at every level) are submitted at once to a :class:`runtime.generate.batch.Batcher` with ``max_batch
= N`` over one page pool, each decoding ``--decode-tokens`` greedy tokens (its stop tokens
masked, so every reply has the same length). Figures per level:

- ``aggregate_decode_tokens_per_s``: rows decoded / seconds, over the steps that only decoded
  (no prefill chunk in them): what one batched step gives all the requests together;
- ``request_decode_tokens_per_s``: each request's own decode rate (median, min, max);
- ``ttft_s``: from the submission of all N to each one's first token (median, max): the wait
  behind the others' prefill is part of it;
- ``peak_rss_bytes``: the level's process at its peak (model, pool and activations).

For a GGUF, each level also runs llama.cpp's own server with N slots on the same file and the
same prompt ids (:mod:`attnchat.bench.llama_server`: ``llama-server -np N``, found through
``ATTNCHAT_LLAMA_SERVER`` or the PATH; said and skipped when there is none), and the table
gives our aggregate decode as a ratio of its.

Speed figures mean something only from a quiet machine: the report names the CPU and the
load average before and after. No asserts on speed anywhere (tests run it on a tiny model for its shape).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from models.child import python_command


def parse_levels(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``.

    Raises:
        ValueError: not comma-separated counts of at least 1.
    """
    try:
        levels = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated request counts such as 1,2,4,8; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency counts must all be at least 1; got {text}")
    return levels


def run_levels(args: argparse.Namespace, model: str, machine: dict) -> int:
    """Every level of ``args.concurrency`` in its own process; prints a table and writes ``args.json``.

    Raises:
        ValueError: bad levels or token counts.
        RuntimeError: a level's process failed (its last line of stderr says why).
    """
    levels = parse_levels(args.concurrency)
    if args.decode_tokens < 3 or args.prefill_tokens < 1:
        raise ValueError("--decode-tokens must be at least 3 and --prefill-tokens at least 1")
    from runtime import read_config

    limit = read_config(model).max_position_embeddings
    if args.prefill_tokens + args.decode_tokens + 1 > limit:
        raise ValueError(f"a request needs {args.prefill_tokens + args.decode_tokens + 1} tokens but the model's "
                         f"context is {limit}; lower --prefill-tokens or --decode-tokens")
    from attnchat.bench import llama_server

    peer = llama_server.find_server() if model.endswith(".gguf") and args.device == "cpu" else None
    if peer is None:
        why = ("not a GGUF on the CPU" if not model.endswith(".gguf") or args.device != "cpu"
               else f"none found: set ${llama_server.ENV} or put llama-server on the PATH")
        print(f"llama-server: not run ({why})")
    results, peers = [], []
    for n in levels:
        cmd = python_command("attnchat.bench.concurrency", "--model", model, "--device", args.device,
                             "--requests", str(n), "--prefill-tokens", str(args.prefill_tokens),
                             "--decode-tokens", str(args.decode_tokens), "--dtype", args.dtype or "default")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the concurrency {n} run failed: {tail}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        prompts = results[-1].pop("prompts")
        if peer is not None:
            peers.append(llama_server.level(peer, model, prompts, args.decode_tokens, os.cpu_count() or 1))
    _table("ours (the batching engine)", results, peers)
    if peers:
        _table(f"llama-server -np N ({peer})", peers, [])
    machine = dict(machine)
    try:
        machine["load_average_after"] = list(os.getloadavg())
    except OSError:
        pass
    print(f"load average before {machine.get('load_average')}, after {machine.get('load_average_after')}")
    if args.json:
        report = {"model": model, "machine": machine, "settings": {
            "concurrency": levels, "prefill_tokens": args.prefill_tokens, "decode_tokens": args.decode_tokens,
            "device": args.device, "dtype": args.dtype}, "levels": results, "llama_server": peers}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _table(title: str, results: list[dict], peers: list[dict]) -> None:
    """One engine's levels; with ``peers`` (the same levels on llama-server) our aggregate as a ratio of its."""
    base = results[0]["aggregate_decode_tokens_per_s"] or 1.0
    print(title)
    print(f"{'requests':>8} {'aggregate tok/s':>16} {'x first':>8} {'per request tok/s':>18} "
          f"{'TTFT median s':>14} {'TTFT max s':>11} {'peak RSS MiB':>13}" + (f" {'x llama-server':>15}" if peers else ""))
    for i, r in enumerate(results):
        ratio = (f" {r['aggregate_decode_tokens_per_s'] / (peers[i]['aggregate_decode_tokens_per_s'] or 1.0):>15.2f}"
                 if peers else "")
        print(f"{r['requests']:>8} {r['aggregate_decode_tokens_per_s']:>16.1f} "
              f"{r['aggregate_decode_tokens_per_s'] / base:>8.2f} {r['request_decode_tokens_per_s']['median']:>18.1f} "
              f"{r['ttft_s']['median']:>14.3f} {r['ttft_s']['max']:>11.3f} {r['peak_rss_bytes'] / 2**20:>13.0f}"
              + ratio)


def _prompts(tokenizer, n: int, length: int) -> list[tuple[int, ...]]:
    """Request ``i``'s prompt: ``length`` ids of a fixed text numbered ``i`` (the same at every level)."""
    out = []
    for i in range(n):
        text = f"Request {i}. " + " ".join(f"The number {i * 1000 + j} follows {i * 1000 + j - 1}." for j in range(length))
        ids = list(tokenizer.encode(text, add_special_tokens=False))[:length]
        out.append(tuple(ids))
    return out


def _level(model_path: str, device: str, dtype: str, requests: int, prefill: int, decode: int) -> dict:
    """One level in this process (the child's work)."""
    import resource

    import torch

    from runtime import load_model
    from runtime.cache.paged import PagePool
    from runtime.generate.batch import Batcher, ReplyRequest
    from runtime.generate.events import Finish

    model = load_model(model_path, device=device, dtype=None if dtype == "default" else dtype)
    c = model.config
    pool = PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=getattr(model, "cache_dtype", None) or model.compute_dtype, device=model.device,
                    windows=c.windows)
    stops = torch.tensor(sorted(model.stop_token_ids), dtype=torch.long, device=model.device)

    def no_stop(generated, row):  # every reply runs its full length
        return row.index_fill_(0, stops, float("-inf")) if stops.numel() else row

    warm = Batcher(model, pool, max_batch=1)  # first calls (allocations, kernel setup) stay out of the figures
    warm.add(ReplyRequest(_prompts(model.tokenizer, 1, 8)[0], max_new_tokens=3, context_limit=16,
                          logits_processors=(no_stop,)))
    warm.run()
    finishes: list = []
    batcher = Batcher(model, pool, max_batch=requests, prefill_chunk=256,
                      on_events=lambda r, evs: finishes.extend(e for e in evs if isinstance(e, Finish)))
    batcher.prepare()  # as the server's engine does when it starts
    limit = prefill + decode + 1
    prompts = _prompts(model.tokenizer, requests, prefill)
    for prompt in prompts:
        batcher.add(ReplyRequest(prompt, max_new_tokens=decode, context_limit=limit, logits_processors=(no_stop,)))
    decode_s, decode_rows = 0.0, 0
    t0 = time.perf_counter()
    while batcher.busy:
        reading = any(r.state in ("waiting", "prefill") for r in batcher.running) or bool(batcher.waiting)
        before, t = batcher.rows_decoded, time.perf_counter()
        batcher.step()
        if not reading:
            decode_s += time.perf_counter() - t
            decode_rows += batcher.rows_decoded - before
    wall = time.perf_counter() - t0
    rates = [f.stats.decode_tokens_per_s for f in finishes]
    ttfts = [f.stats.ttft_s for f in finishes]
    return {"requests": requests, "wall_s": wall, "completion_tokens": sum(f.stats.completion_tokens for f in finishes),
            "aggregate_decode_tokens_per_s": decode_rows / decode_s if decode_s else 0.0,
            "request_decode_tokens_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "ttft_s": {"median": statistics.median(ttfts), "max": max(ttfts)},
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "pages": pool.stats()["pages_total"], "page_bytes": pool.bytes_per_page,
            "prompts": [list(p) for p in prompts]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attnchat.bench.concurrency")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="default")
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    a = p.parse_args(argv)
    print(json.dumps(_level(a.model, a.device, a.dtype, a.requests, a.prefill_tokens, a.decode_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
