"""The loaded GGUF cut short (``truncate``) or replaced while the app runs: the process lives
(unguarded, the next token reads a page past the file's end and SIGBUS kills it, exit 135,
nothing said), the next reply is refused in one line saying to reload, the conversation is
kept, and nothing of the file stays memory-mapped after the load."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.live_server import start_server, stop_server
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

#: A child that loads the file, answers, waits for the test to change the file, answers again.
CHILD = """
import json, sys
from runtime import ChatSession, GenerationSettings, ModelFileChanged, load_model
model = load_model(sys.argv[1], device="cpu")
mapped = [line for line in open("/proc/self/maps") if sys.argv[1] in line]
s = ChatSession(model, settings=GenerationSettings(max_new_tokens=4))
first = list(s.send("hi"))[-1].reason
print(json.dumps({"mapped": mapped, "first": first}), flush=True)
sys.stdin.readline()  # the test changes the file now
try:
    list(s.send("and now?"))
    print(json.dumps({"second": "answered"}), flush=True)
except ModelFileChanged as e:
    print(json.dumps({"second": str(e), "messages": len(s.messages)}), flush=True)
model.file_identity = None  # the weights in memory still answer: they are the process's own
print(json.dumps({"third": list(s.send("still there?"))[-1].reason}), flush=True)
"""


@pytest.fixture
def gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "src").mkdir()
    src = make_tiny_gguf(tmp_path / "src", tokenizer=tiny_tokenizer_metadata())
    dst = tmp_path / "live.gguf"
    shutil.copy(src, dst)
    return dst


@pytest.mark.parametrize("change", ["truncate", "replace"])
def test_a_running_process_survives_its_file_changing(gguf, change):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(gguf)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline() or "{}")
        assert first.get("mapped") == [] and first.get("first") in ("stop", "length"), proc.stderr.read()
        if change == "truncate":
            os.truncate(gguf, 50 << 10)
        else:
            tmp = gguf.with_suffix(".new")
            tmp.write_bytes(b"GGUF" + b"\0" * 1000)
            os.replace(tmp, gguf)
        proc.stdin.write("\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline() or "{}")
        third = json.loads(proc.stdout.readline() or "{}")
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, proc.stderr.read()  # not -7 (SIGBUS)
    assert second["second"].startswith("the model file changed on disk: reload it (live.gguf: ")
    assert ("its size went from" if change == "truncate" else "another file is in its place") in second["second"]
    assert second["messages"] == 2  # the first turn kept, the refused message not added
    assert third["third"] in ("stop", "length")


def test_the_server_answers_503_and_keeps_serving(gguf):
    server = start_server("--model", str(gguf), "--device", "cpu", "--context", "256")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            model = http.get("/models").json()["data"][0]["id"]
            ask = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            assert http.post("/chat/completions", json=ask).status_code == 200
            os.truncate(gguf, 50 << 10)
            for stream in (False, True):
                r = http.post("/chat/completions", json={**ask, "stream": stream})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "model_file_changed"
                assert err["message"].startswith("the model file changed on disk: reload it")
            assert http.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
        assert server.proc.poll() is None
    finally:
        stop_server(server)
