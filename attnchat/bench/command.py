"""``attnchat bench``: our engine side by side with transformers (and llama.cpp when importable).

Each engine runs in its own subprocess (:mod:`attnchat.bench.worker`), interleaved
A B A B over the repetitions, on the same token ids; the report gives medians with
min and max, and ratios (ours over theirs, speed-wise: bigger is better).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from attnchat.bench import quiet
from attnchat.bench import worker as worker_module
from models.child import python_command

#: The benchmark-only environment ``make bench-llamacpp`` builds llama-cpp-python into.
LLAMACPP_VENV = Path(__file__).resolve().parents[2] / ".venv-llamacpp"  # the repository root's (make bench-llamacpp)


def _llamacpp_python() -> str | None:
    """A Python that can import llama_cpp: ``make bench-llamacpp``'s environment, else this one."""
    bench_python = LLAMACPP_VENV / "bin" / "python"
    if bench_python.exists() and any(LLAMACPP_VENV.glob("lib/python*/site-packages/llama_cpp/__init__.py")):
        return str(bench_python)
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def _llamacpp_paths() -> list[str]:
    """What the llamacpp worker imports beyond its own environment: this Python's packages
    (torch for the worker's bookkeeping), after the benchmark environment's own (our package
    comes first through :func:`models.child.python_command`)."""
    import site

    return site.getsitepackages()

#: The options the report records (the global ones of the app are left out).
SETTINGS = ("model", "quick", "repeats", "engines", "dtype", "device", "random_weights", "depths", "decode_tokens",
            "prefill_tokens", "followup_context", "followup_tokens", "busy", "cold", "profile", "json", "plot", "concurrency")
FIGURES = ("load_s", "ttft_s", "prefill_tokens_per_s", "followup_ttft_s", "peak_rss_bytes")
#: Report name -> (bench_worker engine, the weights' dtype: ``True`` = ``--dtype``, None = the
#: engine's default). ``ours-default`` is our engine as the app runs it
#: (runtime.device.default_dtype: on the CPU, float16 weights computing in float32);
#: ``ours-int8`` our 8-bit weights; llama.cpp always runs the GGUF's own quantized weights.
#: ``ours-reproducible`` / ``ours-default-reproducible``: the same with ``--reproducible``
#: (row-invariant kernels and attention, docs/reproducible.md).
#: ``ours-compile`` / ``ours-default-compile``: the same with the compiled decode step (its
#: first build is timed apart, ``compile_s``: cold on a machine's first run, then from
#: inductor's on-disk cache).
ENGINES = {"ours": ("ours", True), "ours-default": ("ours", None), "ours-int8": ("ours", "int8"),
           "ours-compile": ("ours-compile", True), "ours-default-compile": ("ours-compile", None),
           "ours-eager": ("ours-eager", True), "ours-default-eager": ("ours-eager", None),
           "transformers": ("transformers", True),
           "ours-reproducible": ("ours-reproducible", True), "ours-default-reproducible": ("ours-reproducible", None),
           "transformers-compiled": ("transformers-compiled", True), "llamacpp": ("llamacpp", None)}
#: The engines run without ``--engines``, per device. On a GPU: ours as the app decodes
#: there (a CUDA graph) and eagerly, against transformers eager and with a static cache
#: compiled by torch.compile (its fastest decode).
DEFAULT_ENGINES = {"cpu": ("ours", "ours-default", "ours-int8", "transformers", "llamacpp"),
                   "cuda": ("ours", "ours-eager", "ours-default", "transformers", "transformers-compiled")}
#: ``--dtype``'s default per device: the dtype both sides run like for like.
DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark against transformers (and llama.cpp)",
                              description="Side-by-side benchmark; each engine in its own process, interleaved.")
    p.add_argument("--model", metavar="SRC", help="a .gguf file, a model folder, a catalog id or hf.co/OWNER/REPO:QUANT "
                                                  "(fetched first when missing; default: the default model)")
    p.add_argument("--quick", action="store_true", help="depths 128 and 1,024 only (else also 4,096)")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="repetitions per engine (default 3)")
    p.add_argument("--engines", default=None,
                   help="comma-separated: ours,ours-default,ours-default-eager,ours-int8,ours-compile,ours-default-compile,ours-reproducible,ours-default-reproducible,transformers,llamacpp "
                        "(default on the CPU: ours,ours-default,ours-int8,transformers,llamacpp)")
    p.add_argument("--dtype", default=None,
                   help="weights' dtype for ours and transformers, compared like for like (default float32 on the CPU, float16 on CUDA)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every engine runs (default cpu)")
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights of the model's shape (the default model's without a file): speed only")
    p.add_argument("--depths", default=None, help="comma-separated decode depths (overrides --quick)")
    p.add_argument("--decode-tokens", type=int, default=32, metavar="N")
    p.add_argument("--prefill-tokens", type=int, default=512, metavar="N")
    p.add_argument("--followup-context", type=int, default=1000, metavar="N")
    p.add_argument("--followup-tokens", type=int, default=20, metavar="N")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="keep N other processes busy on the CPU while measuring (a desktop with other "
                        "work: a browser, a build); default 0")
    p.add_argument("--cold", action="store_true",
                   help="run our engines with an empty cache folder each time (a first load: nothing converted "
                        "or kept yet) and report what each run left there")
    p.add_argument("--concurrency", metavar="N,N,...",
                   help="instead: the batching engine at these numbers of concurrent requests (e.g. 1,2,4,8), each "
                        "level in its own process on the same prompts: aggregate and per-request decode tok/s, TTFT, "
                        "peak RSS (--prefill-tokens, --decode-tokens; --dtype default: as the app runs)")
    p.add_argument("--profile", action="store_true",
                   help="also profile our engines: a decoded token's time by part, prefill per chunk size")
    p.add_argument("--json", metavar="PATH", help="write the raw figures, summary and ratios as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of decode tok/s against depth")
    p.set_defaults(func=run)
    return p


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(device: str = "cpu") -> dict:
    from runtime.kernels.machine import NOTABLE_FLAGS, cpu_info

    cpu = cpu_info()
    info = {"platform": platform.platform(), "processor": _cpu_name(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "cpu_flags": [f for f in NOTABLE_FLAGS if f in cpu["flags"]], "cpu_capability": cpu["capability"]}
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def _check_args(args: argparse.Namespace) -> str:
    """Every mistake in the options, before minutes of benchmarking; returns the depths.

    Raises:
        ValueError: one line saying which option is wrong and what it needs.
    """
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    for name in ("prefill_tokens", "followup_context", "followup_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 token")
    if args.decode_tokens < 3:
        raise ValueError("--decode-tokens must be at least 3 (the rate is timed from the second decoded token)")
    if args.dtype is None:
        args.dtype = DEFAULT_DTYPE[args.device]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available here; run on a machine with an NVIDIA GPU or use --device cpu")
    depths = args.depths or ("128,1024" if args.quick else "128,1024,4096")
    try:
        values = [int(d) for d in depths.split(",")]
    except ValueError:
        raise ValueError(f"--depths takes comma-separated token counts such as 128,1024; got {depths!r}") from None
    if any(d < 1 for d in values):
        raise ValueError(f"--depths must all be at least 1 token; got {depths}")
    try:
        from runtime.dtypes import QUANTIZED_CACHE_DTYPES, parse_weight_dtype

        if parse_weight_dtype(args.dtype) in QUANTIZED_CACHE_DTYPES:  # transformers has no like-for-like int8
            raise ValueError
    except ValueError:
        raise ValueError(f"unknown --dtype {args.dtype!r}; use float32, bfloat16 or float16 "
                         "(our 8-bit weights run as the ours-int8 engine)") from None
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ValueError(f"{flag} {path}: the folder {folder} does not exist or is not writable; pick another path")
    return ",".join(str(d) for d in values)


def _check_lengths(model: str, args: argparse.Namespace, depths: str) -> None:
    """The longest run must fit the model's context (read from its config, no weights)."""
    from runtime import read_config

    limit = read_config(model).max_position_embeddings
    longest = max([args.prefill_tokens + 1, args.followup_context + args.followup_tokens + 1]
                  + [int(d) + args.decode_tokens for d in depths.split(",")])
    if longest > limit:
        raise ValueError(f"the longest run needs {longest} tokens but the model's context is {limit}; "
                         f"lower --depths, --decode-tokens or the prompt lengths")


def run(args: argparse.Namespace) -> int:
    dtype_asked = args.dtype
    depths = _check_args(args)
    if args.random_weights:
        from attnchat.bench.worker import random_model_folder

        model = random_model_folder(args.model)
    elif args.model is None:
        from models import fetch

        model = str(fetch.ensure_default())
    else:
        from attnchat.fetching import model_source

        model = str(model_source(args.model))
        if not os.path.exists(model):
            raise ValueError(f"{model} does not exist; give a .gguf file, a model folder or hf.co/OWNER/REPO:QUANT")
    if args.concurrency:
        from attnchat.bench.concurrency import run_levels

        args.dtype = dtype_asked
        return run_levels(args, model, _machine(args.device))
    engines = args.engines.split(",") if args.engines else list(DEFAULT_ENGINES[args.device])
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(sorted(unknown))}; use {', '.join(ENGINES)}")
    llamacpp_python = _llamacpp_python() if model.endswith(".gguf") else None
    if "llamacpp" in engines and llamacpp_python is None:
        engines.remove("llamacpp")
        print("llama.cpp: llama-cpp-python is not importable (run `make bench-llamacpp`), or the model is not a GGUF; skipped",
              file=sys.stderr)
    _check_lengths(model, args, depths)
    machine = _machine(args.device)
    print(f"CPU: {machine['processor']} ({machine['cpus']} CPUs, torch {machine.get('cpu_capability')}); "
          f"flags: {' '.join(machine['cpu_flags']) or 'none of note'}", file=sys.stderr)
    common = ["--model", model, "--device", args.device, "--prefill-tokens", str(args.prefill_tokens), "--depths", depths,
              "--decode-tokens", str(args.decode_tokens), "--followup-context", str(args.followup_context),
              "--followup-tokens", str(args.followup_tokens)] + (["--profile"] if args.profile else [])
    raw: dict[str, list[dict]] = {e: [] for e in engines}
    machine["busy_processes"] = args.busy
    with quiet.busy_processes(args.busy):
        _run_engines(args, engines, common, llamacpp_python, raw)
    summary = {}
    for engine, runs in raw.items():
        s = {f: _summary([r[f] for r in runs]) for f in FIGURES}
        s["decode_tokens_per_s"] = {d: _summary([r["decode_tokens_per_s"][d] for r in runs]) for d in runs[0]["decode_tokens_per_s"]}
        s["kv_bytes_per_token"] = runs[0]["kv_bytes_per_token"]
        s["dtype"] = runs[0]["dtype"]
        s["decode_mode"] = runs[0].get("decode_mode")
        if runs[0].get("kernels"):
            s["kernels"] = runs[0]["kernels"]
        if runs[0].get("threads"):
            s["threads"] = [r["threads"] for r in runs]  # each run's thread governors at its end
        if runs[0].get("compile_s") is not None:
            s["compile_s"] = [r["compile_s"] for r in runs]  # each run's: the first is cold on a new machine
        if runs[0].get("first_reply_s") is not None:
            s["first_reply_s"] = _summary([r["first_reply_s"] for r in runs])
        if runs[0].get("cache_bytes") is not None:
            s["cache_bytes"] = _summary([r["cache_bytes"] for r in runs])
        if runs[0].get("peak_gpu_bytes") is not None:
            s["peak_gpu_bytes"] = _summary([r["peak_gpu_bytes"] for r in runs])
        summary[engine] = s
    ratios = _ratios(summary, depths.split(","))
    noisy = sorted({e for e, runs in raw.items() for r in runs if r.get("noisy")})
    withheld, as_if_quiet = None, None
    if noisy:  # figures from a busy machine are kept, but no ratio is claimed from them
        withheld = (f"runs of {', '.join(noisy)} were taken above a load of {quiet.QUIET_LOAD}: "
                    "no ratio is claimed; run again on a quiet machine")
        ratios, as_if_quiet = {k: None for k in ratios}, ratios
    report = {"model": model, "machine": machine, "settings": {k: getattr(args, k) for k in SETTINGS},
              "depths": [int(d) for d in depths.split(",")], "raw": raw, "summary": summary, "ratios": ratios,
              "ratios_withheld": withheld, "ratios_if_quiet": as_if_quiet}
    _print_table(summary, ratios)
    if withheld:
        print(f"NOISY: {withheld}")
    from attnchat.bench.profile import print_profile

    for engine, runs in raw.items():
        if runs[0].get("profile"):
            print_profile(engine, runs[-1]["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


def _run_engines(args: argparse.Namespace, engines: list[str], common: list[str], llamacpp_python: str | None,
                 raw: dict[str, list[dict]]) -> None:
    """Each engine's worker ``args.repeats`` times, interleaved (A B A B), its figures into ``raw``."""
    for rep in range(args.repeats):
        for engine in engines:  # interleaved: A B A B
            t0 = time.perf_counter()
            worker, dtype = ENGINES[engine]
            dtype = args.dtype if dtype is True else dtype
            python, paths = (llamacpp_python, _llamacpp_paths()) if worker == "llamacpp" else (sys.executable, [])
            cmd = python_command("attnchat.bench.worker", "--engine", worker, *common, python=python, paths=paths)
            env = None
            cold = tempfile.mkdtemp(prefix="attnchat-bench-cache-") if args.cold and worker != "llamacpp" else None
            if cold:
                env = dict(os.environ if env is None else env, ATTNCHAT_CACHE_DIR=cold)
            before = quiet.load_average()
            try:
                proc = subprocess.run(cmd + (["--dtype", dtype] if dtype else []), capture_output=True, text=True, env=env)
            finally:
                if cold:
                    shutil.rmtree(cold, ignore_errors=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                if proc.returncode == worker_module.USER_ERROR:
                    raise ValueError(f"the {engine} benchmark could not run: {tail}")
                raise RuntimeError(f"the {engine} benchmark run failed: {tail}")
            run = quiet.mark(json.loads(proc.stdout.strip().splitlines()[-1]), before, quiet.load_average())
            raw[engine].append(run)
            print(f"  rep {rep + 1}/{args.repeats} {engine}: {time.perf_counter() - t0:.1f} s ({quiet.describe(run)})",
                  file=sys.stderr)


def _ratios(summary: dict, depths: list[str]) -> dict:
    def med(engine, *path):
        node = summary.get(engine)
        for p in path:
            if node is None:
                return None
            node = node.get(p)
        return node["median"] if node else None

    # The "1k" depth is 1024 when measured, else the deepest measured.
    d1k = "1024" if "1024" in depths else depths[-1]
    ours_dec, tf_dec, lc_dec = med("ours", "decode_tokens_per_s", d1k), med("transformers", "decode_tokens_per_s", d1k), med("llamacpp", "decode_tokens_per_s", d1k)
    ours_fu, tf_fu = med("ours", "followup_ttft_s"), med("transformers", "followup_ttft_s")
    ours_pf, tf_pf = med("ours", "prefill_tokens_per_s"), med("transformers", "prefill_tokens_per_s")
    div = lambda a, b: (a / b) if a and b else None  # noqa: E731
    dflt_dec, dflt_fu = med("ours-default", "decode_tokens_per_s", d1k), med("ours-default", "followup_ttft_s")
    return {
        # ours and transformers at the same dtype (--dtype)
        "decode_1k_vs_transformers": div(ours_dec, tf_dec),
        "followup_ttft_vs_transformers": div(tf_fu, ours_fu),
        "prefill_512_vs_transformers": div(ours_pf, tf_pf),
        # llama.cpp runs the GGUF's quantized weights: compared with ours as the app runs it
        # (ours-default) when measured, else with ours at --dtype
        "decode_1k_vs_llamacpp": div(dflt_dec or ours_dec, lc_dec),
        "decode_128_vs_llamacpp": div(med("ours-default", "decode_tokens_per_s", depths[0]) or med("ours", "decode_tokens_per_s", depths[0]),
                                      med("llamacpp", "decode_tokens_per_s", depths[0])),
        "prefill_512_vs_llamacpp": div(med("ours-default", "prefill_tokens_per_s") or ours_pf, med("llamacpp", "prefill_tokens_per_s")),
        # memory and load the other way round: above 1 is ours smaller or faster
        "peak_rss_llamacpp_over_ours": div(med("llamacpp", "peak_rss_bytes"), med("ours-default", "peak_rss_bytes") or med("ours", "peak_rss_bytes")),
        "load_llamacpp_over_ours": div(med("llamacpp", "load_s"), med("ours-default", "load_s") or med("ours", "load_s")),
        "default_eager_decode_1k_over_default": div(med("ours-default-eager", "decode_tokens_per_s", d1k), dflt_dec),
        # ours as the app runs it against transformers at --dtype
        "default_decode_1k_vs_transformers": div(dflt_dec, tf_dec),
        "default_followup_ttft_vs_transformers": div(tf_fu, dflt_fu),
        # our 8-bit weights against transformers at --dtype and against llama.cpp's GGUF
        "int8_decode_1k_vs_transformers": div(med("ours-int8", "decode_tokens_per_s", d1k), tf_dec),
        "int8_decode_1k_vs_llamacpp": div(med("ours-int8", "decode_tokens_per_s", d1k), lc_dec),
        # on a GPU: ours (the app's decode mode) against transformers' compiled static-cache
        # decode, and against our own eager decode
        "decode_1k_vs_transformers_compiled": div(ours_dec, med("transformers-compiled", "decode_tokens_per_s", d1k)),
        "decode_1k_vs_ours_eager": div(ours_dec, med("ours-eager", "decode_tokens_per_s", d1k)),
        # on the CPU: the compiled decode step over the eager one, at --dtype and as the app runs
        "compiled_decode_1k_vs_ours": div(med("ours-compile", "decode_tokens_per_s", d1k), ours_dec),
        "default_compiled_decode_1k_vs_default": div(med("ours-default-compile", "decode_tokens_per_s", d1k), dflt_dec),
    }


def _print_table(summary: dict, ratios: dict) -> None:
    depths = list(next(iter(summary.values()))["decode_tokens_per_s"])
    gpu = any("peak_gpu_bytes" in s for s in summary.values())
    cold = any("cache_bytes" in s for s in summary.values())
    head = (["engine", "dtype", "load s", "TTFT s", "prefill tok/s"] + [f"decode@{d}" for d in depths]
            + ["follow-up TTFT s", "peak RSS MB", "first reply s"] + (["cache MB"] if cold else [])
            + (["peak GPU MB"] if gpu else []))
    rows = []
    for engine, s in summary.items():
        rows.append([engine, str(s.get("dtype", "")).split(" ")[0], f"{s['load_s']['median']:.2f}", f"{s['ttft_s']['median']:.3f}",
                     f"{s['prefill_tokens_per_s']['median']:.0f}"]
                    + [f"{s['decode_tokens_per_s'][d]['median']:.1f}" for d in depths]
                    + [f"{s['followup_ttft_s']['median']:.3f}", f"{s['peak_rss_bytes']['median'] / 1e6:.0f}",
                       f"{s['first_reply_s']['median']:.1f}" if "first_reply_s" in s else "-"]
                    + ([f"{s['cache_bytes']['median'] / 1e6:.1f}" if "cache_bytes" in s else "-"] if cold else [])
                    + ([f"{s['peak_gpu_bytes']['median'] / 1e6:.0f}" if "peak_gpu_bytes" in s else "-"] if gpu else []))
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    for engine, s in summary.items():
        if s.get("compile_s"):
            print(f"compile, {engine}: {', '.join(f'{c:.1f}' for c in s['compile_s'])} s (each run's first compiled step)")
    for engine, s in summary.items():
        k = s.get("kernels")
        if k:
            print(f"kernels, {engine} ({s['dtype']}): decode {k['decode']}, prefill {k['prefill']}"
                  + (f" (measured us per token: {k['timings_us']})" if k.get("timings_us") else ""))
    for engine, s in summary.items():
        if s.get("threads"):
            per_run = "; ".join(
                f"decode {t['decode']['threads']}, prefill " + " ".join(f"{k}:{g['threads']}" for k, g in t["prefill"].items())
                for t in s["threads"])
            print(f"threads, {engine}: {per_run} (each run's choice at its end)")
    print("ratios (ours over peer, speed-wise): " + ", ".join(f"{k}={v:.2f}" if v is not None else f"{k}=null" for k, v in ratios.items()))


def plot(report: dict, path: str) -> None:
    """A PNG of decode tok/s against depth, one line per engine (pyqtgraph, offscreen)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])  # noqa: F841 (keeps Qt alive)
    pg.setConfigOptions(background="w", foreground="k", antialias=True)
    where = report["machine"].get("gpu") or f"{report['machine'].get('processor')}, {report['machine'].get('cpus')} CPUs"
    w = pg.PlotWidget(title=f"decode speed against depth ({where})")
    w.resize(800, 500)
    w.addLegend()
    w.setLabel("bottom", "context depth (tokens)")
    w.setLabel("left", "decode tokens / s")
    colours = {"ours": "#d62728", "ours-default": "#ff7f0e", "ours-eager": "#9467bd", "ours-int8": "#8c564b", "ours-compile": "#e377c2", "ours-default-compile": "#bcbd22", "transformers": "#1f77b4",
               "transformers-compiled": "#17becf", "llamacpp": "#2ca02c"}
    for engine, s in report["summary"].items():
        xs = [int(d) for d in s["decode_tokens_per_s"]]
        ys = [s["decode_tokens_per_s"][d]["median"] for d in s["decode_tokens_per_s"]]
        w.plot(xs, ys, pen=pg.mkPen(colours.get(engine, "k"), width=3), symbol="o", symbolBrush=colours.get(engine, "k"),
               name=f"{engine} ({s['dtype']})")
    w.setYRange(0, max(max(d["median"] for d in s["decode_tokens_per_s"].values()) for s in report["summary"].values()) * 1.45)  # the legend sits above the lines
    w.show()  # laid out like a window (offscreen), so the axis labels get their room
    app.processEvents()
    if not w.grab().save(path):
        raise OSError(f"could not write the plot to {path}")
    w.close()
