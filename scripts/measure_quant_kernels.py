"""Time and check the quantized linear kernels on a GGUF's own matrices.

    .venv/bin/python scripts/measure_quant_kernels.py FILE.gguf [FILE.gguf ...] [--threads N] [--json OUT]

For every matrix a token passes through (each layer's projections and the LM head, the
tied embedding when there is no output.weight) and every CPU kernel of
:data:`runtime.kernels.quantized.QUANT_KERNELS` that takes its block type: microseconds for
one row and for 64 rows (best of a few rounds, candidates interleaved so a busy machine
slows them alike), relative error against float64 on the same dequantized weights, and
the bytes the kernel adds beside the file's blocks. Then a token's whole pass: every
matrix once, in file order, per kernel (a kernel that does not take a type runs the
``f16`` kernel there, named in the table). Figures depend on the machine's load: compare
within one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict

import torch

from runtime.kernels.chooser import best_time_us
from runtime.kernels.quantized import QUANT_KERNELS, candidates, prepared, quant_linear
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.quant_types import block_type
from runtime.weights.quant_weight import QuantWeight

SKIP: list[str] = []  # kernels left out (--skip)


def token_matrices(path) -> list[tuple[str, QuantWeight]]:
    g = read_gguf_tensors(path)
    out = []
    for name, info in g.tensors.items():
        if len(info.shape) == 2 and name.startswith("blk."):
            out.append((name, QuantWeight(g.raw(name), block_type(info.ggml_type), *info.shape)))
    head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    info = g.tensors[head]
    out.append((head, QuantWeight(g.raw(head), block_type(info.ggml_type), *info.shape)))
    return out


def measure_file(path: str, rounds: int) -> dict:
    mats = token_matrices(path)
    groups: dict[tuple, list[QuantWeight]] = defaultdict(list)
    for name, w in mats:
        groups[(w.btype.name, w.rows, w.cols)].append(w)
    per_matrix = {}
    for (tname, rows, cols), ws in groups.items():
        w = ws[0]
        names = [k for k in candidates(w.btype, "cpu") if k not in SKIP]
        xs = {M: torch.randn(M, cols) for M in (1, 64)}
        W64 = w.dequantized(torch.float64)
        entry = {"count": len(ws), "file_bytes": w.file_bytes, "kernels": {}}
        for k in names:
            t0 = time.perf_counter()
            prepared(w, k)
            prep_s = time.perf_counter() - t0
            errs = {}
            for M, x in xs.items():
                y = quant_linear(x, w, k).double()
                ref = x.double() @ W64.T
                errs[M] = ((y - ref).norm() / ref.norm()).item()
            entry["kernels"][k] = {"prepare_s": round(prep_s, 3), "extra_bytes": w.extra_bytes,
                                   "rel_err_1": errs[1], "rel_err_64": errs[64], "us_1": float("inf"), "us_64": float("inf")}
            w.prepared.pop(k, None)
        for _ in range(rounds):  # interleaved: each round times every kernel once
            for k in names:
                for M, x in xs.items():
                    us = best_time_us(lambda: quant_linear(x, w, k), 5 if M == 1 else 2)
                    e = entry["kernels"][k]
                    e[f"us_{M}"] = min(e[f"us_{M}"], round(us, 1))
        for k in names:
            w.prepared.pop(k, None)
        per_matrix[f"{tname} {rows}x{cols}"] = entry
        del W64
    # a whole token: every matrix once, in order, per kernel (f16 where the kernel does not take the type)
    whole = {}
    kinds = sorted({k for e in per_matrix.values() for k in e["kernels"]}, key=list(QUANT_KERNELS).index)
    for k in kinds:
        plan = [(w, k if k in candidates(w.btype, "cpu") else "ggml" if "ggml" in kinds else "f16") for _, w in mats]
        for w, kk in plan:
            prepared(w, kk)
        xs = {}
        for w, _ in plan:
            xs.setdefault(w.cols, torch.randn(1, w.cols))
        xs64 = {c: torch.randn(64, c) for c in xs}

        def one(xs=xs, plan=plan):
            for w, kk in plan:
                quant_linear(xs[w.cols], w, kk)

        def sixty_four(xs=xs64, plan=plan):
            for w, kk in plan:
                quant_linear(xs[w.cols], w, kk)

        one()
        extra = sum(w.extra_bytes for w, _ in plan)
        whole[k] = {"ms_per_token_1": round(best_time_us(one, rounds) / 1e3, 2),
                    "ms_per_token_64": round(best_time_us(sixty_four, 2) / 1e3 / 64, 3),
                    "extra_bytes": extra, "fallback": sorted({f"{kk} for {w.btype.name}" for w, kk in plan if kk != k})}
        for w, kk in plan:
            w.prepared.clear()
    return {"file": path, "matrices": per_matrix, "whole_token": whole,
            "file_bytes": sum(w.file_bytes for _, w in mats)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--skip", action="append", default=[], help="leave out a kernel (repeatable)")
    args = ap.parse_args(argv)
    SKIP.extend(args.skip)
    torch.set_num_threads(args.threads)
    from runtime.kernels import machine

    report = {"cpu": machine.cpu_info()["model"], "threads": args.threads, "torch": torch.__version__,
              "python": platform.python_version(), "load_before": machine.machine_load(), "files": []}
    with torch.inference_mode():
        for f in args.files:
            r = measure_file(f, args.rounds)
            report["files"].append(r)
            print(f"\n{f}  ({r['file_bytes'] / 2**20:.1f} MiB of matrices; {report['cpu']}, {args.threads} threads)")
            for key, e in r["matrices"].items():
                print(f"  {key} x{e['count']}")
                for k, v in e["kernels"].items():
                    print(f"    {k:14s} 1 row {v['us_1']:9.1f} us  64 rows {v['us_64']:10.1f} us   rel.err {v['rel_err_1']:.4f}"
                          f"  +{v['extra_bytes'] / 2**20:.1f} MiB  prepare {v['prepare_s']:.2f} s")
            print("  whole token (every matrix once, in order):")
            for k, v in r["whole_token"].items():
                fb = f" ({', '.join(v['fallback'])})" if v["fallback"] else ""
                print(f"    {k:14s} {v['ms_per_token_1']:8.2f} ms/token decode  {v['ms_per_token_64']:7.3f} ms/token at 64 rows"
                      f"  +{v['extra_bytes'] / 2**20:.0f} MiB{fb}")
    report["load_after"] = machine.machine_load()
    print(f"\nload average before/after: {report['load_before']} / {report['load_after']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
