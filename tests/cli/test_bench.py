"""`attnchat bench` on a tiny model: the harness runs both engines and reports what it promises."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runtime.tiny_models import make_tiny_model


def test_bench_harness_on_a_tiny_model(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "attnchat", "bench", "--model", str(folder), "--engines", "ours,ours-default,transformers",
         "--repeats", "2", "--depths", "16,48", "--decode-tokens", "4", "--prefill-tokens", "16",
         "--followup-context", "40", "--followup-tokens", "4", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=300,
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
    r = report["ratios"]
    assert r["decode_1k_vs_llamacpp"] is None
    assert r["decode_1k_vs_transformers"] > 0 and r["followup_ttft_vs_transformers"] > 0
    expected = report["summary"]["ours"]["decode_tokens_per_s"]["48"]["median"] / report["summary"]["transformers"]["decode_tokens_per_s"]["48"]["median"]
    assert abs(r["decode_1k_vs_transformers"] - expected) < 1e-9
    expected = report["summary"]["ours-default"]["decode_tokens_per_s"]["48"]["median"] / report["summary"]["transformers"]["decode_tokens_per_s"]["48"]["median"]
    assert abs(r["default_decode_1k_vs_transformers"] - expected) < 1e-9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode@48" in proc.stdout and "ratios" in proc.stdout


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "int3"], "unknown --dtype 'int3'"),
    (["--depths", "abc"], "--depths takes comma-separated token counts"),
    (["--depths", "0"], "--depths must all be at least 1 token"),
    (["--prefill-tokens", "0"], "--prefill-tokens must be at least 1 token"),
    (["--decode-tokens", "1"], "--decode-tokens must be at least 2"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist or is not writable"),
    (["--plot", "/nonexistent/dir/x.png"], "does not exist or is not writable"),
    (["--depths", "100000"], "the model's context is"),
])
def test_bad_options_exit_2_before_benchmarking(tiny_folder, extra, message):
    folder = tiny_folder
    proc = subprocess.run([sys.executable, "-m", "attnchat", "bench", "--model", str(folder), "--engines", "ours"] + extra,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "rep 1/" not in proc.stderr  # nothing ran
