"""What the reproducible mode costs: prefill and decode speed and resident
memory of the default model as the app loads it, with and without ``reproducible=True``.

    .venv/bin/python scripts/repro_cost.py [--rounds 2] [--prompt-tokens 300] [--decode-tokens 32]

Each mode runs in its own process, the modes alternating ``--rounds`` times (a busy machine's
noise hits both); prints one JSON line per run and the medians. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def one(mode: str, prompt_tokens: int, decode_tokens: int) -> dict:
    import torch

    from runtime import load_model

    before = _rss()
    model = load_model(None, device="cpu", reproducible=mode == "reproducible")
    ids = torch.randint(100, 40_000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        cache = model.new_cache(prompt_tokens + decode_tokens + 1)
        t0 = time.perf_counter()
        logits = model.logits(ids, cache, last_only=True)
        prefill = time.perf_counter() - t0
        tok = int(logits[0, -1].argmax())
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            tok = int(model.decode_next(tok, cache)[0, -1].argmax())
        decode = time.perf_counter() - t0
    return {"mode": mode, "dtype": str(model.dtype).removeprefix("torch."), "kernel": model.kernels.prefill,
            "prefill_tokens_per_s": prompt_tokens / prefill, "decode_tokens_per_s": decode_tokens / decode,
            "rss_mb": (_rss() - before) / 1e6, "threads": torch.get_num_threads()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.prompt_tokens, a.decode_tokens)))
        return 0
    runs: dict[str, list[dict]] = {"default": [], "reproducible": []}
    for _ in range(a.rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--prompt-tokens", str(a.prompt_tokens),
                                  "--decode-tokens", str(a.decode_tokens)], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(r)
            print(json.dumps(r), flush=True)
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in ("prefill_tokens_per_s", "decode_tokens_per_s",
                                                                       "rss_mb")} for mode, rs in runs.items()}
    print(json.dumps({"medians": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
