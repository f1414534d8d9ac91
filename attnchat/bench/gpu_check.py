"""``python -m attnchat.bench.gpu_check`` (``make gpu-check``): the GPU checks and the GPU benchmark.

One command for a machine with an NVIDIA GPU, under 5 minutes, nothing from the
network: it runs with the torch already installed there, and uses the default model's
file when it is in the model folder, else seeded random weights of its shape (speed
does not depend on the weights' values; the answer checks then say they were skipped).

Checks, each printed as ``PASS``/``FAIL``/``SKIP`` with its numbers:

1. the attention fast path (both GQA strategies, the CUDA backends) equals the
   reference path in float32, float16 and bfloat16;
2. for float32, float16 and bfloat16 weights, and a GGUF's own quantized blocks (the
   4-bit engine: tinygemm's int4 kernel; a GGUF file only): prefill plus cached decode
   steps equal the full forward (float32 within 1e-3), and the CUDA-graph step equals
   the eager step (same greedy tokens, logits within the dtype's rounding);
3. with the real model: the default dtype answers "Paris" to the capital question.

Then ``attnchat bench --device cuda --quick`` prints its table. Exit status 0 when
every check passed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from models.child import attnchat_command

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: Tolerances of a cached decode step against the full forward, per weight dtype. float32:
#: the order of summation alone (1e-3 on logits of magnitude ~20); 16-bit: what one rounding
#: of the activations per layer allows.
TOLERANCES = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 3e-1}
#: A quantized GGUF's own blocks (tinygemm's int4 kernel takes bfloat16 activations,
#: other types float16 copies): checked like bfloat16, on a GGUF file only.
GGUF_TOLERANCE = 3e-1


def _result(name: str, ok: bool | None, detail: str) -> bool | None:
    label = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    print(f"{label}  {name}: {detail}", flush=True)
    return ok


def check_attention(device: str = "cuda") -> bool:
    import torch

    from runtime.model.attention import (
        AttentionKernels,
        attention_fast,
        attention_kernels,
        attention_reference,
    )

    g = torch.Generator().manual_seed(0)
    q1 = torch.randn(1, 9, 1, 64, generator=g)
    qb = torch.randn(1, 9, 30, 64, generator=g)
    k = torch.randn(1, 3, 512, 64, generator=g)
    v = torch.randn(1, 3, 512, 64, generator=g)
    mask = (torch.arange(512) <= 300).view(1, 1, 1, 512)
    ok = True
    for kernels in (attention_kernels(device), AttentionKernels("sdpa", attention_kernels(device).sdpa_backends)):
        for dtype, tol in (("float32", 1e-4), ("float16", 3e-3), ("bfloat16", 3e-2)):
            dt = getattr(torch, dtype)
            worst = 0.0
            for q, m, causal in ((q1, mask, False), (qb, None, True), (q1, None, True)):
                ref, _ = attention_reference(q, k, v, causal=causal, mask=m)
                out = attention_fast(q.to(device, dt), k.to(device, dt), v.to(device, dt), causal=causal,
                                     mask=None if m is None else m.to(device), kernels=kernels)
                worst = max(worst, (out.float().cpu() - ref).abs().max().item())
            ok &= bool(_result(f"attention {kernels.decode_gqa} {dtype}", worst <= tol, f"max |diff| {worst:.2e} (bound {tol:g})"))
    return ok


def check_model(path, random: bool, device: str = "cuda") -> bool:
    import torch

    from runtime import load_model
    from runtime.model.decode_step import DecodeStep

    ok = True
    ids = list(range(1000, 1200))  # 200 ordinary token ids
    checks = dict(TOLERANCES, **({"gguf": GGUF_TOLERANCE} if str(path).endswith(".gguf") else {}))
    for dtype, tol in checks.items():
        try:
            model = load_model(path, device=device, dtype=dtype)
            full = model.logits(ids)[0]  # (T, V)
            cache = model.new_cache(1024)
            model.logits(ids[:150], cache)
            steps = torch.stack([model.decode_next(t, cache)[0, -1].clone() for t in ids[150:]])
            diff = (steps - full[150:]).abs().max().item()
            ok &= bool(_result(f"{dtype}: cached decode steps = full forward", diff <= tol, f"max |diff| {diff:.2e} (bound {tol:g}), mode {model.decode_mode}"))
            # the graph against the eager step, greedy, across a capacity bucket (256)
            outs = {}
            for mode in ("eager", model.decode_mode):
                cache = model.new_cache(1024)
                logits = model.logits(ids[:240], cache, last_only=True)[0, -1]
                step, toks, rows = DecodeStep(model.decoder, mode), [], []
                for _ in range(40):
                    toks.append(int(logits.argmax()))
                    logits = step(toks[-1], cache)[0, -1].clone()
                    rows.append(logits)
                outs[mode] = (toks, torch.stack(rows))
            same = outs["eager"][0] == outs[model.decode_mode][0]
            d = (outs["eager"][1] - outs[model.decode_mode][1]).abs().max().item()
            ok &= bool(_result(f"{dtype}: {model.decode_mode} step = eager step", same and d <= tol,
                               f"same greedy tokens: {same}, max |diff| {d:.2e}"))
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check, reported
            ok &= bool(_result(f"{dtype}: load and decode", False, f"{type(e).__name__}: {e}"))
    return ok


def check_paris(path, random: bool, device: str = "cuda") -> bool | None:
    if random:
        return _result("default dtype answers Paris", None, "no model file here (random weights)")
    from runtime import load_model
    from runtime.generate.chat_format import Message, encode_messages

    model = load_model(path, device=device)
    ids = encode_messages(model.tokenizer, [Message("user", "What is the capital of France?")])
    cache = model.new_cache(256)
    logits = model.logits(ids, cache, last_only=True)
    out = []
    for _ in range(24):
        t = int(logits[0, -1].argmax())
        if t in model.stop_token_ids:
            break
        out.append(t)
        logits = model.decode_next(t, cache)
    text = model.decode(out)
    return _result(f"default dtype ({str(model.dtype).removeprefix('torch.')}) answers Paris", "Paris" in text, repr(text))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attnchat.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-bench", action="store_true", help="only the checks")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: CUDA is not available here; run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    from models.catalog import DEFAULT_MODEL
    from models.store import installed_path

    path = installed_path(DEFAULT_MODEL)
    random = path is None
    if random:
        from attnchat.bench.worker import random_model_folder

        path = random_model_folder(None)
    t0 = time.perf_counter()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"model: {'random weights of the default shape' if random else path}", flush=True)
    results = [check_attention(args.device), check_model(path, random, args.device), check_paris(path, random, args.device)]
    print(f"checks: {time.perf_counter() - t0:.0f} s", flush=True)
    status = 0 if all(r is not False for r in results) else 1
    if not args.no_bench:
        cmd = attnchat_command("bench", "--device", "cuda", "--quick", "--repeats", "1",
                               "--depths", "128,1024,4096,8000", "--followup-context", "4000", "--followup-tokens", "30",
                               "--json", "gpu-bench.json")
        if random:
            cmd.append("--random-weights")
        status |= subprocess.call(cmd)
    return status


if __name__ == "__main__":
    sys.exit(main())
