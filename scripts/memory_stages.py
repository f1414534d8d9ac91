"""Resident memory (RSS) of a process at each stage of serving a model: Python with torch and
transformers imported, the tokenizer alone, the model loaded, after a first short turn and
after a long one (what the memory planner must count).

    .venv/bin/python scripts/memory_stages.py [--model SRC] [--dtype D] [--json PATH]

Each model in its own process (this one); prints one JSON object. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def status(field: str) -> int:
    """A byte figure of /proc/self/status (``RssAnon``, ``VmHWM``: the peak RSS so far)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tokenizer-only", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out: dict = {"model": a.model or "default", "dtype": a.dtype}
    stages = out["stages"] = []

    def stage(name: str, **extra) -> None:
        gc.collect()
        from runtime.device import trim_heap

        trim_heap()
        stages.append({"stage": name, "rss": rss(), "anon": status("RssAnon"), "peak": status("VmHWM"), **extra})
        reset_peak()

    import torch  # noqa: F401
    import transformers  # noqa: F401

    import runtime

    stage("imported")
    from runtime.weights.gguf.converted import gguf_cache_dir
    from runtime.weights.sources import resolve_source

    path = resolve_source(a.model)
    if a.tokenizer_only:
        from transformers import AutoTokenizer

        folder = gguf_cache_dir(path)
        tok = AutoTokenizer.from_pretrained(str(folder))
        stage("tokenizer", vocab=len(tok), tokenizer_json_bytes=(folder / "tokenizer.json").stat().st_size)
    else:
        t0 = time.perf_counter()
        model = runtime.load_model(a.model, device="cpu", dtype=a.dtype)
        stage("loaded", weights_bytes=model.weights_bytes, load_s=time.perf_counter() - t0,
              vocab=len(model.tokenizer))
        s = runtime.ChatSession(model, settings=runtime.GenerationSettings(max_new_tokens=16))
        f = s.run(s.send("Name three colours of the rainbow."))
        stage("short turn", prompt_tokens=f.stats.prompt_tokens, kv_allocated=s.cache.allocated_bytes)
        f = s.run(s.send("Tell me about the sea. " * 60))  # ~400 tokens: two prefill chunks
        stage("long turn", prompt_tokens=f.stats.prompt_tokens, kv_allocated=s.cache.allocated_bytes)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
