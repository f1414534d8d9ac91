"""``attnchat cache-eval``: each cache policy at each budget against the full cache, on one or
more models: needles found in a long conversation, the NLL change on a held-out
continuation, the KV bytes kept (:mod:`attnchat.bench.cache_eval`).

``attnchat cache-eval [--model M ...] [--policies ...] [--budgets 0.25,0.5] [--json PATH] [--plot PATH]``
prints a Markdown table per model; ``--json`` writes every figure (answers included),
``--plot`` a PNG of accuracy and NLL change against the budget.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache-eval", help="measure the KV-cache policies against the full cache",
        description="Needles in a long conversation, NLL change on a held-out continuation and KV bytes kept, "
                    "for each cache policy and budget.")
    p.add_argument("--model", action="append", metavar="SRC",
                   help="a .gguf file, a model folder or a catalog id; repeat for several (default: the default model)")
    p.add_argument("--policies", default=None, help="comma-separated, of: sinks-window,h2o,snapkv,tova,key-norm (default: all)")
    p.add_argument("--budgets", default="0.25,0.5", help="comma-separated shares of the tokens read (default 0.25,0.5)")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="where the needle sits, as shares of the conversation")
    p.add_argument("--needles", type=int, default=2, metavar="N", help="needles (codes) per depth (default 2)")
    p.add_argument("--length", type=int, default=1024, metavar="TOKENS", help="conversation length (default 1,024)")
    p.add_argument("--nll-context", type=int, default=768, metavar="TOKENS", help="held-out tokens read first (default 768)")
    p.add_argument("--nll-tokens", type=int, default=256, metavar="TOKENS", help="held-out tokens scored (default 256)")
    p.add_argument("--step", type=int, default=None, metavar="TOKENS", help="tokens evicted at least per eviction (default 16)")
    p.add_argument("--quick", action="store_true", help="one needle at depths 0.1, 0.5, 0.9 and a 768-token conversation")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of accuracy and NLL change against the budget")
    p.set_defaults(func=run)
    return p


def _floats(text: str, flag: str, lo: float, hi: float) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers such as 0.25,0.5; got {text!r}") from None
    if not values or any(not lo < v < hi for v in values):
        raise ValueError(f"{flag} values must lie between {lo:g} and {hi:g} (exclusive); got {text}")
    return values


def _check(args: argparse.Namespace) -> dict:
    """Every option checked before a model loads; returns the harness's keyword arguments.

    Raises:
        ValueError: one line naming the option and what it needs.
    """
    from attnchat.bench.cache_eval import DEFAULT_POLICIES

    policies = tuple(args.policies.split(",")) if args.policies else DEFAULT_POLICIES
    unknown = [p for p in policies if p not in DEFAULT_POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; use some of {','.join(DEFAULT_POLICIES)}")
    kw = dict(policies=policies, budgets=_floats(args.budgets, "--budgets", 0, 1),
              depths=_floats(args.depths, "--depths", 0, 1) if not args.quick else (0.1, 0.5, 0.9),
              needles=1 if args.quick else args.needles, length=768 if args.quick else args.length,
              nll_context=args.nll_context, nll_tokens=args.nll_tokens)
    if args.step is not None:
        kw["step"] = args.step
    if min(kw["needles"], kw["length"], kw["nll_context"], kw["nll_tokens"], kw.get("step", 1)) < 1:
        raise ValueError("--needles, --length, --nll-context, --nll-tokens and --step must be at least 1")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ValueError(f"{flag} {path}: the folder {folder} does not exist or is not writable; pick another path")
    return kw


def run(args: argparse.Namespace) -> int:
    kw = _check(args)
    from attnchat.bench.cache_eval import evaluate, plot, table
    from attnchat.bench.command import _machine
    from attnchat.fetching import model_source
    from models import fetch
    from runtime import load_model

    sources = args.model or [str(fetch.ensure_default())]
    machine = _machine("cuda" if str(args.device).startswith("cuda") else "cpu")
    where = machine.get("gpu") or f"{machine['processor']}, {machine['cpus']} CPUs"
    reports = []
    for src in sources:
        path = str(model_source(src))
        model = load_model(path, device=args.device)
        t0 = time.perf_counter()
        load_before = machine.get("load_average")
        report = evaluate(model, progress=lambda line: print(line, file=sys.stderr, flush=True), **kw)
        report.update(model=path, model_name=model.name, device=str(model.device), dtype=str(model.compute_dtype),
                      seconds=time.perf_counter() - t0, settings={k: list(v) if isinstance(v, tuple) else v
                                                                  for k, v in kw.items()})
        try:
            report["load_average"] = {"before": load_before, "after": list(os.getloadavg())}
        except OSError:
            pass
        reports.append(report)
        full = report["full"]
        print(f"\n{model.name} on {where}: the full cache found {full['needle_passed']} of {full['needle_trials']} "
              f"needles ({full['accuracy']:.0%}); {report['seconds']:.0f} s\n")
        print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "reports": reports}, f, indent=2)
    if args.plot:
        plot(reports, args.plot, where)
    return 0
