"""llama.cpp's own server with N slots (``llama-server -np N``) as the peer of ``bench --concurrency``.

No torch and no Qt here. The binary is not part of the app: it is built with cmake from the
llama.cpp source that the llama-cpp-python sdist vendors (llama-cpp-python's own server decodes
one sequence at a time), and found by :func:`find_server` (``ATTNCHAT_LLAMA_SERVER``, else
``llama-server`` on the PATH). Each level starts a fresh server on a free loopback port with N
slots of the request's length each, on the same GGUF file and the same prompt token ids as our
level, sends one warm-up request, then the N requests at once (streamed, greedy, ``ignore_eos``
so each runs its full length) and reads llama.cpp's own timings. Figures per level, named as
ours:

- ``aggregate_decode_tokens_per_s``: the sum of the requests' decode rates (llama.cpp's
  ``predicted_per_second``): all N decode together over the same span, so the sum is the rate
  of all of them together (ours counts rows over its decode-only steps: the same quantity);
- ``request_decode_tokens_per_s``: those rates (median, min, max);
- ``ttft_s``: from the submission of all N to each one's first streamed token (median, max);
- ``peak_rss_bytes``: the server process's peak (``VmHWM``).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence

#: The environment variable naming the binary.
ENV = "ATTNCHAT_LLAMA_SERVER"
START_TIMEOUT_S = 120


def find_server() -> str | None:
    """The llama-server binary: ``$ATTNCHAT_LLAMA_SERVER`` when it names an executable file,
    else ``llama-server`` on the PATH, else None."""
    path = os.environ.get(ENV)
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which("llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> urllib.request.addinfourl:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _stream(url: str, prompt: Sequence[int], decode: int, t0: float, out: dict) -> None:
    """One streamed greedy completion; ``out`` gets the first token's time and the final timings."""
    body = {"prompt": list(prompt), "n_predict": decode, "ignore_eos": True, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "stream": True}
    try:
        with _post(url + "/completion", body) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "first_s" not in out and (chunk.get("content") or chunk.get("tokens")):
                    out["first_s"] = time.perf_counter() - t0
                if chunk.get("stop"):
                    out["timings"] = chunk.get("timings", {})
    except Exception as e:  # reported by the caller, which needs every request's figures
        out["error"] = repr(e)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def level(binary: str, model_path: str, prompts: Sequence[Sequence[int]], decode: int, threads: int) -> dict:
    """One level: ``len(prompts)`` slots, each request at once (see the module).

    Raises:
        RuntimeError: the server did not start, or a request failed (its error or the server's last line).
    """
    n = len(prompts)
    per_slot = max(len(p) for p in prompts) + decode + 16
    port = _free_port()
    cmd = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
           "-c", str(n * per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {(lines or ['no output'])[-1].strip()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        _stream(url, prompts[0][:8], 3, time.perf_counter(), {})  # warm-up, out of the figures
        outs: list[dict] = [{} for _ in prompts]
        t0 = time.perf_counter()
        workers = [threading.Thread(target=_stream, args=(url, p, decode, t0, o)) for p, o in zip(prompts, outs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        bad = [o.get("error", "no final timings") for o in outs if "timings" not in o or "first_s" not in o]
        if bad:
            raise RuntimeError(f"a llama-server request failed: {bad[0]}")
        rates = [o["timings"]["predicted_per_second"] for o in outs]
        ttfts = [o["first_s"] for o in outs]
        return {"requests": n, "wall_s": wall, "completion_tokens": sum(o["timings"]["predicted_n"] for o in outs),
                "aggregate_decode_tokens_per_s": sum(rates),
                "request_decode_tokens_per_s": {"median": statistics.median(rates), "min": min(rates),
                                                "max": max(rates)},
                "ttft_s": {"median": statistics.median(ttfts), "max": max(ttfts)},
                "peak_rss_bytes": _peak_rss(proc.pid), "threads": threads}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
