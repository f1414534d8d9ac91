"""Greedy agreement of prefill kernels and KV-cache dtypes with a float32-dequantized run.

    .venv/bin/python scripts/prefill_quality.py FILE.gguf [--kernels widen,widen-bf16,...]
        [--cache-dtypes float32,float16] [--tokens 128] [--llamacpp-python PATH]

The reference is scripts/quant_quality.py's (the file's weights dequantized to float32,
greedy ``--tokens`` tokens from each prompt), over its prompts and five more. Prefill: the
prompt and the reference read in ONE prefill per case with each prefill kernel (every block
type of the file on it, decode on ggml), the share of positions whose greedy token is the
reference's; llama.cpp (``make bench-llamacpp``'s environment) the same through one ``eval``
with ``logits_all``. Decode: teacher-forced one token at a time through the app's decode step
with a cache of each dtype. Quality, not speed: a busy machine gives the same tokens.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MORE_PROMPTS = ("Tell me about the history of Rome.", "Give me a recipe for pancakes.",
                "What are the benefits of exercise?", "Describe how a computer works.",
                "Write a haiku about autumn.")


def _llamacpp_worker(path: str, cases_json: str) -> None:
    import os

    import numpy as np
    from llama_cpp import Llama

    cases = json.loads(Path(cases_json).read_text())
    llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=os.cpu_count() or 2, logits_all=True, verbose=False)
    agree = total = 0
    for c in cases:
        ids = c["prompt_ids"] + c["reference"][:-1]
        llm.reset()
        llm.eval(ids)
        start = len(c["prompt_ids"]) - 1
        pred = [int(np.argmax(llm.scores[i])) for i in range(start, len(ids))]
        agree += sum(a == b for a, b in zip(pred, c["reference"]))
        total += len(c["reference"])
    print(json.dumps({"agreement": agree / total}))


def _prefill_agreement(m, cases) -> float:
    import torch

    agree = total = 0
    with torch.inference_mode():
        for c in cases:
            ids = c["prompt_ids"] + c["reference"][:-1]
            logits = m.logits(ids, m.new_cache(len(ids) + 1, dtype="float32"), last_only=False)[0]
            pred = logits[len(c["prompt_ids"]) - 1:].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(pred, c["reference"]))
            total += len(c["reference"])
    return agree / total


def _decode_agreement(m, cases, dtype: str) -> float:
    import torch

    agree = total = 0
    with torch.inference_mode():
        for c in cases:
            prompt, ref = c["prompt_ids"], c["reference"]
            cache = m.new_cache(len(prompt) + len(ref) + 1, dtype=dtype)
            logits = m.logits(prompt, cache, last_only=True)
            for tok in ref:
                agree += int(logits[0, -1].argmax()) == tok
                logits = m.decode_next(tok, cache)
            total += len(ref)
    return agree / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--kernels", default="widen,ggml-exact,widen-bf16,int4pack-bf16,ggml")
    ap.add_argument("--cache-dtypes", default="float32,float16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / ".venv-llamacpp" / "bin" / "python")
    ap.add_argument("--llamacpp-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llamacpp_worker:
        _llamacpp_worker(*args.llamacpp_worker)
        return 0
    import quant_quality as qq

    from runtime import load_model
    from runtime.kernels.quant_choice import QuantChoice, kernel_pairs
    from runtime.model import quant_layers

    qq.PROMPTS = tuple(qq.PROMPTS) + MORE_PROMPTS
    cases, _ = qq.reference(args.file, args.tokens)
    out: dict = {"machine": qq.machine(), "file": args.file, "prefill": {}, "decode": {}}
    m = load_model(args.file, device="cpu")
    types = {p.btype for layer in quant_layers.quant_layers(m.decoder) for p in layer.parts}
    for k in args.kernels.split(","):
        pairs = {t.name: ("ggml", k) if ("ggml", k) in kernel_pairs(t, "cpu") else kernel_pairs(t, "cpu")[0] for t in types}
        quant_layers.set_choice(m.decoder, QuantChoice(pairs), "cpu")
        out["prefill"][k] = _prefill_agreement(m, cases)
        print(f"prefill {k}: {out['prefill'][k]:.4f}", flush=True)
    quant_layers.set_choice(m.decoder, m.quant_kernels, "cpu")
    for dt in args.cache_dtypes.split(","):
        out["decode"][dt] = _decode_agreement(m, cases, dt)
        print(f"decode, {dt} cache: {out['decode'][dt]:.4f}", flush=True)
    if args.llamacpp_python.exists():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cases, f)
        r = subprocess.run([str(args.llamacpp_python), __file__, args.file, "--llamacpp-worker", args.file, f.name],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            out["prefill"]["llamacpp"] = json.loads(r.stdout.strip().splitlines()[-1])["agreement"]
            print(f"prefill llama.cpp: {out['prefill']['llamacpp']:.4f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
