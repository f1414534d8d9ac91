"""`attnchat bench` on a tiny model: the harness runs both engines and reports what it promises."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runtime.tiny_models import make_tiny_model
from tests.hang import HANG_S


def test_bench_harness_on_a_tiny_model(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "attnchat", "bench", "--model", str(folder), "--engines", "ours,ours-default,transformers",
         "--repeats", "2", "--depths", "16,48", "--decode-tokens", "4", "--prefill-tokens", "16",
         "--followup-context", "40", "--followup-tokens", "4", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    assert set(report["raw"]) == {"ours", "ours-default", "transformers"}
    # ours and transformers like for like (--dtype, float32 by default); ours-default as the app runs.
    assert report["summary"]["ours"]["dtype"] == report["summary"]["transformers"]["dtype"] == "float32"
    assert report["summary"]["ours-default"]["dtype"] == "float16 weights, float32 compute"
    assert all(len(runs) == 2 for runs in report["raw"].values())  # two repetitions each
    for engine, s in report["summary"].items():
        assert set(s["decode_tokens_per_s"]) == {"16", "48"}
        for d in s["decode_tokens_per_s"].values():
            assert 0 < d["min"] <= d["median"] <= d["max"]
        assert s["load_s"]["median"] > 0 and s["followup_ttft_s"]["median"] > 0
        assert s["peak_rss_bytes"]["median"] > 10_000_000
    # Same cache size: both engines agree on KV bytes per token (2 x layers x KV heads x head dim x 4).
    assert report["summary"]["ours"]["kv_bytes_per_token"] == report["summary"]["transformers"]["kv_bytes_per_token"]
    # Runs above the quiet load (the test machine's own, whatever it is now) are marked, and then
    # no ratio is claimed (test_busy_processes_spin_while_the_block_runs: --busy's hogs)
    runs = [run for rs in report["raw"].values() for run in rs]
    assert all(run["load_before"] is not None and run["load_after"] is not None for run in runs)
    for run in runs:
        assert run["noisy"] == (max(run["load_before"], run["load_after"]) > 1.5)
    if any(run["noisy"] for run in runs):
        assert "no ratio is claimed" in report["ratios_withheld"] and "NOISY" in proc.stdout
        assert set(report["ratios"].values()) == {None}
        r = report["ratios_if_quiet"]
    else:
        assert report["ratios_withheld"] is None and report["ratios_if_quiet"] is None
        r = report["ratios"]
    assert r["decode_1k_vs_llamacpp"] is None
    assert r["decode_1k_vs_transformers"] > 0 and r["followup_ttft_vs_transformers"] > 0
    expected = report["summary"]["ours"]["decode_tokens_per_s"]["48"]["median"] / report["summary"]["transformers"]["decode_tokens_per_s"]["48"]["median"]
    assert abs(r["decode_1k_vs_transformers"] - expected) < 1e-9
    expected = report["summary"]["ours-default"]["decode_tokens_per_s"]["48"]["median"] / report["summary"]["transformers"]["decode_tokens_per_s"]["48"]["median"]
    assert abs(r["default_decode_1k_vs_transformers"] - expected) < 1e-9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode@48" in proc.stdout and "ratios" in proc.stdout
    # The machine and our kernel choices are named (runtime.kernels measures them per machine).
    from runtime.kernels.choice import CANDIDATES
    from runtime.kernels.machine import NOTABLE_FLAGS, cpu_info

    assert report["machine"]["cpu_flags"] == [f for f in NOTABLE_FLAGS if f in cpu_info()["flags"]]
    assert "CPU: " in proc.stderr and "flags: " in proc.stderr
    import torch

    k = report["summary"]["ours"]["kernels"]
    assert k["decode"] in CANDIDATES[torch.float32]["decode"] and k["prefill"] in CANDIDATES[torch.float32]["prefill"]
    assert report["summary"]["ours-default"]["kernels"]["decode"] in CANDIDATES[torch.float16]["decode"]
    assert "kernels" not in report["summary"]["transformers"]
    assert f"kernels, ours (float32): decode {k['decode']}, prefill {k['prefill']}" in proc.stdout
    # Our thread governors say where they ended.
    from runtime.kernels.threads import max_threads, thread_options

    assert report["machine"]["busy_processes"] == 0
    for run in report["summary"]["ours"]["threads"]:
        assert run["decode"]["threads"] in thread_options(max_threads()) and run["decode"]["median_ms"]
    assert "threads, ours: decode " in proc.stdout and "threads" not in report["summary"]["transformers"]


def test_busy_processes_spin_while_the_block_runs():
    """--busy's hogs use CPU while the benchmark runs, and none is left after (not even when the
    block raises)."""
    import time
    from pathlib import Path

    from attnchat.bench.quiet import busy_processes

    def cpu_ticks(pid: int) -> int:  # utime + stime, /proc/PID/stat fields 14 and 15
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    with pytest.raises(RuntimeError, match="the benchmark failed"):
        with busy_processes(2) as hogs:
            assert len(hogs) == 2 and all(h.poll() is None for h in hogs)
            deadline = time.monotonic() + HANG_S
            while min(cpu_ticks(h.pid) for h in hogs) < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert min(cpu_ticks(h.pid) for h in hogs) >= 5  # each has spun for 50 ms of CPU at least
            raise RuntimeError("the benchmark failed")
    assert all(h.returncode is not None for h in hogs)  # killed and reaped
    assert not any(Path(f"/proc/{h.pid}").exists() for h in hogs)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "int3"], "unknown --dtype 'int3'"),
    (["--depths", "abc"], "--depths takes comma-separated token counts"),
    (["--depths", "0"], "--depths must all be at least 1 token"),
    (["--prefill-tokens", "0"], "--prefill-tokens must be at least 1 token"),
    (["--decode-tokens", "2"], "--decode-tokens must be at least 3"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist or is not writable"),
    (["--plot", "/nonexistent/dir/x.png"], "does not exist or is not writable"),
    (["--depths", "100000"], "the model's context is"),
])
def test_bad_options_exit_2_before_benchmarking(tiny_folder, extra, message, attnchat_cli):
    status, _out, err = attnchat_cli("bench", "--model", str(tiny_folder), "--engines", "ours", *extra)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "rep 1/" not in err  # nothing ran


def test_gpu_bench_engines_run_on_the_cpu(tiny_folder):
    """The engines `bench --device cuda` adds (ours eager, ours static, transformers with a
    static cache) and --random-weights, run here on the CPU by the same worker."""
    from attnchat.bench import worker as bench_worker

    random_folder = bench_worker.random_model_folder(str(tiny_folder), seed=1)
    import os

    assert random_folder != str(tiny_folder) and os.path.exists(os.path.join(random_folder, "model.safetensors"))
    assert bench_worker.random_model_folder(str(tiny_folder), seed=1) == random_folder  # made once
    results = {}
    for engine in ("ours-eager", "transformers-compiled"):
        args = bench_worker.argparse.Namespace(
            engine=engine, model=random_folder, dtype="float32", device="cpu", seed=0, prefill_tokens=16,
            depths=[16], decode_tokens=5, followup_context=20, followup_tokens=4)
        results[engine] = bench_worker.measure(args)
    assert results["ours-eager"]["decode_mode"] == "eager"
    for r in results.values():
        assert r["decode_tokens_per_s"]["16"] > 0 and r["peak_gpu_bytes"] is None and r["device"] == "cpu"


def test_bench_refuses_cuda_without_a_gpu(tiny_folder):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "attnchat", "bench", "--model", str(tiny_folder), "--device", "cuda"],
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_compiled_engine_reports_its_compile_time(tiny_folder):
    """ours-compile decodes with the compiled step and times its first build apart."""
    from attnchat.bench import worker as bench_worker

    args = bench_worker.argparse.Namespace(
        engine="ours-compile", model=str(tiny_folder), dtype="float32", device="cpu", seed=0, prefill_tokens=16,
        depths=[16], decode_tokens=5, followup_context=20, followup_tokens=4)
    r = bench_worker.measure(args)
    assert r["decode_mode"] == "compile" and r["compile_s"] > 0 and r["decode_tokens_per_s"]["16"] > 0


def test_a_process_age_is_within_what_its_parent_waited():
    """``first_reply_s`` counts from the worker's start: its age read in a fresh child lies
    between 0 and the parent's wall time around the child (to the kernel's 10 ms tick). psutil's
    creation time, from a boot time in whole seconds, read up to a second more."""
    import subprocess
    import sys
    import time

    code = "from attnchat.bench.worker import _process_seconds as s; print(s())"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    waited = time.perf_counter() - t0
    age = float(out.stdout)
    assert 0.0 <= age <= waited + 0.011, (age, waited)
