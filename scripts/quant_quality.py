"""Greedy agreement of quantized engines with a float32-dequantized run.

    .venv/bin/python scripts/quant_quality.py FILE.gguf [FILE.gguf ...] [--tokens 128] [--json OUT]
        [--llamacpp-python PATH] [--reference SOURCE.gguf]

The reference: our decoder with the file's weights dequantized to float32 (exactly the
numbers its blocks hold) and float32 arithmetic, greedy ``--tokens`` tokens from each of
three prompts (through the chat template when the file has one). Against its own file's
float32 run, an engine's agreement measures its arithmetic on the blocks (activation
rounding, summation order), not what the block type lost. ``--reference SOURCE.gguf``
takes the reference from another file of the same model and tokenizer instead (the
weights a requantized file was made from): then the ``ours-float32`` engine (the file
dequantized, float32 arithmetic) gives the type's own loss, and the other engines the
type's loss and their arithmetic together. Each engine then reads
the reference continuation one token at a time (teacher forcing, the decode path: ours
as the app decodes, llama.cpp's ``eval`` of one token) and the table gives the share of
positions whose greedy token is the reference's, and where a free greedy run first
leaves the reference. llama.cpp runs in ``make bench-llamacpp``'s environment, in its own
process, on the same token ids. Engines: ``ours`` (the app's default for the file, its
quantized blocks), ``ours-float16`` (``--dtype float16``), ``ours-float32`` (``--dtype
float32``), ``llamacpp``. Files of other
block types made from the default model's weights: scripts/requantize_gguf.py. Each row
names the file's block types, the CPU and the load average (quality, not speed: a busy
machine gives the same tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = ("The capital of France is", "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.")
ROOT = Path(__file__).resolve().parent.parent


def _llamacpp_worker(path: str, cases: list[dict]) -> list[dict]:
    """In llama.cpp's environment: per case, teacher-forced greedy tokens and a free greedy run."""
    import numpy as np
    from llama_cpp import Llama

    # logits_all: llama-cpp-python keeps the logits it computed only with it (scores[position])
    llm = Llama(model_path=path, n_ctx=2048, n_threads=os.cpu_count() or 2, logits_all=True, verbose=False)
    out = []
    for case in cases:
        prompt, ref = case["prompt_ids"], case["reference"]
        llm.reset()
        llm.eval(prompt)
        forced = []
        for tok in ref:
            forced.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([tok])
        llm.reset()
        free = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            free.append(int(tok))
            if len(free) >= len(ref):
                break
        out.append({"forced": forced, "free": free})
    return out


def _ours(path: str, dtype: str | None, cases: list[dict]) -> list[dict]:
    import torch

    from runtime import load_model

    m = load_model(path, device="cpu", dtype=dtype)
    out = []
    with torch.inference_mode():
        for case in cases:
            prompt, ref = case["prompt_ids"], case["reference"]
            cache = m.new_cache(len(prompt) + len(ref) + 1)
            logits = m.logits(prompt, cache, last_only=True)
            forced = []
            for tok in ref:
                forced.append(int(logits[0, -1].argmax()))
                logits = m.decode_next(tok, cache)
            cache = m.new_cache(len(prompt) + len(ref) + 1)
            logits = m.logits(prompt, cache, last_only=True)
            free = []
            for _ in ref:
                free.append(int(logits[0, -1].argmax()))
                logits = m.decode_next(free[-1], cache)
            out.append({"forced": forced, "free": free})
    return out, getattr(m, "dtype_name", str(m.dtype).removeprefix("torch."))


def reference(path: str, tokens: int) -> tuple[list[dict], str]:
    """Prompt ids and the float32-dequantized model's greedy continuation per prompt."""
    import torch

    from runtime import load_model

    m = load_model(path, device="cpu", dtype="float32")
    cases = []
    with torch.inference_mode():
        for p in PROMPTS:
            if m.has_chat_template:
                ids = m.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=True)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            else:
                ids = ([m.tokenizer.bos_token_id] if m.tokenizer.bos_token_id is not None else []) + m.encode(p)
            cache = m.new_cache(len(ids) + tokens + 1)
            logits = m.logits(ids, cache, last_only=True)
            ref = []
            for _ in range(tokens):  # never stops at an end token: 128 positions each
                ref.append(int(logits[0, -1].argmax()))
                logits = m.decode_next(ref[-1], cache)
            cases.append({"prompt": p, "prompt_ids": ids, "reference": ref, "text": m.decode(ref)})
    return cases, m.name


def machine() -> dict:
    """The CPU's name and the load average while the figures were taken."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "cpus": os.cpu_count(), "load_average": [round(x, 1) for x in os.getloadavg()]}


def block_types(path: str) -> dict[str, int]:
    """Matrices per block type in the file (its tensor table)."""
    from runtime.weights.gguf.mmap import read_gguf_tensors
    from runtime.weights.quant_types import type_name

    counts: dict[str, int] = {}
    for info in read_gguf_tensors(path).tensors.values():
        if len(info.shape) == 2:
            counts[type_name(info.ggml_type)] = counts.get(type_name(info.ggml_type), 0) + 1
    return counts


def score(cases: list[dict], results: list[dict]) -> dict:
    agree = total = 0
    first = []
    for case, r in zip(cases, results):
        ref = case["reference"]
        agree += sum(a == b for a, b in zip(r["forced"], ref))
        total += len(ref)
        first.append(next((i for i, (a, b) in enumerate(zip(r["free"], ref)) if a != b), len(ref)))
    return {"agreement": agree / total, "first_divergence": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engines", default="ours,ours-float16,llamacpp")
    ap.add_argument("--json")
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / ".venv-llamacpp" / "bin" / "python",
                    help="the python of an environment with llama-cpp-python (default: make bench-llamacpp's)")
    ap.add_argument("--reference", type=Path,
                    help="the reference run's file (same model and tokenizer; default: each file itself)")
    ap.add_argument("--llamacpp-worker", nargs=2, metavar=("FILE", "CASES_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llamacpp_worker:
        path, cases_file = args.llamacpp_worker
        print(json.dumps(_llamacpp_worker(path, json.loads(Path(cases_file).read_text()))))
        return 0
    report = []
    shared = reference(str(args.reference), args.tokens) if args.reference else None
    for f in args.files:
        cases, name = shared or reference(f, args.tokens)
        row = {"file": f, "model": name, "tokens": args.tokens, "types": block_types(f), "machine": machine(),
               "reference": str(args.reference or f), "engines": {}, "cases": cases}
        for engine in args.engines.split(","):
            if engine == "llamacpp":
                py = args.llamacpp_python
                if not py.exists():
                    print("llama.cpp: run `make bench-llamacpp` first; skipped", file=sys.stderr)
                    continue
                cases_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"attnchat-quality-{os.getpid()}.json"
                cases_file.write_text(json.dumps(cases))
                import site

                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + site.getsitepackages()))
                proc = subprocess.run([str(py), __file__, "--llamacpp-worker", f, str(cases_file)],
                                      capture_output=True, text=True, env=env)
                cases_file.unlink(missing_ok=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"llama.cpp failed: {proc.stderr.strip().splitlines()[-1:]}")
                results, label = json.loads(proc.stdout.strip().splitlines()[-1]), "GGUF blocks (llama.cpp)"
            else:
                dtype = {"ours-float16": "float16", "ours-float32": "float32"}.get(engine)
                results, label = _ours(f, dtype, cases)
            row["engines"][engine] = {"weights": label, **score(cases, results)}
        report.append(row)
        mix = ", ".join(f"{t} x{n}" for t, n in sorted(row["types"].items(), key=lambda kv: -kv[1]))
        m = machine()
        ref = f"{Path(args.reference).name}'s float32 run" if args.reference else "float32"
        print(f"\n{Path(f).name}: {name} ({mix}); {args.tokens} tokens x {len(PROMPTS)} prompts, teacher-forced greedy "
              f"agreement with {ref}; {m['cpu']}, {m['cpus']} CPUs, load {m['load_average']}:")
        row["machine"]["load_average_after"] = m["load_average"]
        for engine, s in row["engines"].items():
            print(f"  {engine:14s} {s['weights']:26s} {s['agreement']:.3f}   first free divergence {s['first_divergence']}")
        if args.json:  # after each file: a long run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
