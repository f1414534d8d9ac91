"""`attnchat bench --concurrency` on a tiny model: every level runs, in its own process, and
reports the figures it promises (no speed is asserted: speed lives in the benchmark itself)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.hang import HANG_S
from tests.runtime.tiny_models import make_tiny_model


def test_concurrency_levels_on_a_tiny_model(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "levels.json"
    proc = subprocess.run([sys.executable, "-m", "attnchat", "bench", "--model", str(folder), "--concurrency", "1,3",
                           "--prefill-tokens", "12", "--decode-tokens", "5", "--json", str(out)],
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [lv["requests"] for lv in report["levels"]] == [1, 3]
    assert report["machine"]["processor"] and report["settings"]["concurrency"] == [1, 3]
    for lv in report["levels"]:
        assert lv["completion_tokens"] == 5 * lv["requests"]  # stop tokens masked: full length each
        assert lv["aggregate_decode_tokens_per_s"] > 0 and lv["request_decode_tokens_per_s"]["min"] > 0
        assert 0 < lv["ttft_s"]["median"] <= lv["ttft_s"]["max"] < lv["wall_s"]
        assert lv["peak_rss_bytes"] > 50 << 20 and lv["pages"] >= 1
    assert report["llama_server"] == [] and len(report["machine"]["load_average_after"]) == 3
    table = proc.stdout.splitlines()
    assert table[0] == "llama-server: not run (not a GGUF on the CPU)"  # a model folder: llama.cpp cannot read it
    assert table[1] == "ours (the batching engine)" and table[2].split()[:3] == ["requests", "aggregate", "tok/s"]
    assert [line.split()[0] for line in table[3:5]] == ["1", "3"] and table[5].startswith("load average before [")
    assert len(table) == 6


def test_llama_server_is_found_by_its_variable_or_the_path(tmp_path, monkeypatch):
    from attnchat.bench.llama_server import ENV, find_server

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setenv(ENV, str(binary))
    assert find_server() is None  # not executable
    binary.chmod(0o755)
    assert find_server() == str(binary)
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_server() == str(binary)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert find_server() is None


def test_bad_levels_exit_2(tmp_path, attnchat_cli):
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    status, _, err = attnchat_cli("bench", "--model", str(folder), "--concurrency", "1,x")
    assert status == 2 and "comma-separated request counts" in err, err
    status, _, err = attnchat_cli("bench", "--model", str(folder), "--concurrency", "2", "--prefill-tokens", "200")
    assert status == 2 and "the model's context is 128" in err, err
