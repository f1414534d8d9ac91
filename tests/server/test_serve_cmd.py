"""``attnchat serve`` refuses what it must before loading anything: exit 2, one line on stderr.

The model path does not exist, so a check made after the load would fail on the model
instead: the messages prove the address is checked first.
"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from attnchat.serve_cmd import is_loopback
from tests.server.conftest import serve_env

MISSING = "/nonexistent/model.gguf"


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnchat", "serve", "--model", MISSING, *args],
                          capture_output=True, text=True, timeout=60, env=serve_env())


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.10", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_refuses_a_public_address_without_a_key():
    r = _serve("--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnchat: error:") and "--api-key" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_a_taken_port_is_one_line_before_the_load():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve("--port", str(port))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and str(port) in r.stderr and "in use" in r.stderr, r.stderr


def test_the_server_imports_no_qt():
    code = ("import sys, attnchat.server, attnchat.serve_cmd\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'PySide6', 'shiboken6', 'pyqtgraph', 'desktop'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("origin", ["*", "localhost:3000", "http://x/app"])
def test_a_cors_origin_that_is_not_an_origin_is_one_line(origin):
    r = _serve("--cors-origin", origin)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a web origin" in r.stderr, r.stderr


def test_api_key_file_problems_are_one_line(tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    for args, words in [(["--api-key-file", str(tmp_path / "nope")], "cannot read --api-key-file"),
                        (["--api-key-file", str(empty)], "holds no key"),
                        (["--api-key-file", str(empty), "--api-key", "k"], "not allowed with")]:
        r = _serve(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_an_api_key_file_is_read_before_the_load(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-from-a-file\nignored\n")
    r = _serve("--host", "0.0.0.0", "--port", "0", "--api-key-file", str(key))
    # Accepted as the key a public address needs: the error is about the model, later.
    assert r.returncode == 2 and "--api-key" not in r.stderr and "model.gguf" in r.stderr, r.stderr


def test_a_default_max_tokens_past_the_limit_is_one_line():
    r = _serve("--max-tokens", "5000", "--max-tokens-limit", "4096")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--max-tokens-limit" in r.stderr, r.stderr
