"""The server's resident memory before and after one long request.

Starts ``attnchat serve`` (the default model, CPU, ``--context 8192``), reads its RSS
(``/proc/PID/status`` VmRSS) when idle, sends one request of about ``--tokens`` prompt
tokens, and reads the RSS and the pool's KV-cache bytes again once the reply is over and
the server idle. Linux only. Usage::

    .venv/bin/python scripts/server_rss.py [--tokens 7900] [--model PATH] [-- extra serve args]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx2 as httpx  # noqa: E402

from tests.live_server import start_server, stop_server  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=7900, help="prompt tokens to send (about)")
    p.add_argument("--model", default=None, help="model file (default: the default model)")
    p.add_argument("serve_args", nargs="*", help="more `attnchat serve` arguments (after --)")
    args = p.parse_args()
    if args.model is None:
        from models import fetch

        args.model = str(fetch.ensure_default())
    server = start_server("--model", args.model, "--context", "8192", "--device", "cpu", *args.serve_args)
    try:
        with httpx.Client(base_url=server.base_url, timeout=900) as http:
            model = http.get("/models").json()["data"][0]["id"]
            short = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi!"}]}
            http.post("/chat/completions", json=short).raise_for_status()  # warm: first-request allocations
            time.sleep(1)
            before = rss_mib(server.proc.pid)
            # "word " is one token of SmolLM2's tokenizer each; the template adds a few.
            long = {"model": model, "max_tokens": 16,
                    "messages": [{"role": "user", "content": "word " * (args.tokens - 30)}]}
            t0 = time.monotonic()
            r = http.post("/chat/completions", json=long)
            r.raise_for_status()
            seconds = time.monotonic() - t0
            time.sleep(1)
            after = rss_mib(server.proc.pid)
            stats = http.get("/attnchat/stats").json()
        print(json.dumps({
            "prompt_tokens": r.json()["usage"]["prompt_tokens"], "request_s": round(seconds, 1),
            "rss_idle_mib": round(before, 1), "rss_after_mib": round(after, 1),
            "kv_used_bytes": stats["kv_used_bytes"], "kv_allocated_bytes": stats["kv_allocated_bytes"],
            "serve_args": args.serve_args,
        }, indent=1))
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
