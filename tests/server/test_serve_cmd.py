"""``attnchat serve`` refuses what it must before loading anything: exit 2, one line on stderr.

The model path does not exist, so a check made after the load would fail on the model
instead: the messages prove the address is checked first. The checks run in-process
(``attnchat.cli.main``; a subprocess costs seconds of imports each); one goes through
``python -m attnchat`` to prove the entry point says the same.
"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from attnchat.server.command import API_KEY_ENV, is_loopback
from tests.live_server import serve_env
from tests.hang import HANG_S

MISSING = "/nonexistent/model.gguf"


@pytest.fixture
def serve(attnchat_cli, monkeypatch):
    """``serve(*args) -> (status, stdout, stderr)`` of ``attnchat serve --model MISSING ARGS``
    run in-process (tests/conftest.py)."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    return lambda *args: attnchat_cli("serve", "--model", MISSING, *args)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.10", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_refuses_a_public_address_without_a_key():
    """Through the real entry point, ``python -m attnchat``."""
    r = subprocess.run([sys.executable, "-m", "attnchat", "serve", "--model", MISSING, "--host", "0.0.0.0",
                        "--port", "0"], capture_output=True, text=True, timeout=HANG_S, env=serve_env())
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnchat: error:") and "--api-key" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_a_taken_port_is_one_line_before_the_load(serve):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, _, err = serve("--port", str(port))
    assert status == 2
    assert err.count("\n") == 1 and str(port) in err and "in use" in err, err


def test_the_server_imports_no_qt():
    code = ("import sys, attnchat.server, attnchat.server.command\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'PySide6', 'shiboken6', 'pyqtgraph', 'desktop'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("origin", ["*", "localhost:3000", "http://x/app"])
def test_a_cors_origin_that_is_not_an_origin_is_one_line(serve, origin):
    status, _, err = serve("--cors-origin", origin)
    assert status == 2 and err.count("\n") == 1 and "not a web origin" in err, err


def test_api_key_file_problems_are_one_line(serve, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    empty.chmod(0o600)
    for args, words in [(["--api-key-file", str(tmp_path / "nope")], "cannot read --api-key-file"),
                        (["--api-key-file", str(empty)], "holds no key"),
                        (["--api-key-file", str(empty), "--api-key", "k"], "not allowed with")]:
        status, _, err = serve(*args)
        assert status == 2 and err.count("\n") == 1 and words in err, err


def test_an_api_key_file_is_read_before_the_load(serve, tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-from-a-file\nignored\n")
    key.chmod(0o600)
    status, _, err = serve("--host", "0.0.0.0", "--port", "0", "--api-key-file", str(key))
    # Accepted as the key a public address needs: the error is about the model, later.
    assert status == 2 and "--api-key" not in err and "model.gguf" in err, err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")
def test_a_key_file_others_may_read_is_refused_and_one_its_group_may_read_is_warned_about(serve, tmp_path):
    """A key file others may read (0644) is refused in one line; one only its group may read
    (0640) is used with a warning."""
    key = tmp_path / "key"
    key.write_text("sk-from-a-file\n")
    key.chmod(0o644)
    status, _, err = serve("--api-key-file", str(key))
    assert status == 2 and err == (f"attnchat: error: --api-key-file {str(key)!r} is readable by every user of this "
                                   f"machine (mode 0644); run `chmod 600 {key}` and start again\n")
    key.chmod(0o640)
    status, _, err = serve("--api-key-file", str(key))
    warning, error = err.splitlines()
    assert warning == (f"attnchat: warning: --api-key-file {str(key)!r} is readable by its group (mode 0640); "
                       f"`chmod 600 {key}` keeps the key yours alone")
    assert status == 2 and "model.gguf" in error  # accepted: the error is about the model, later


def test_a_default_max_tokens_past_the_limit_is_one_line(serve):
    status, _, err = serve("--max-tokens", "5000", "--max-tokens-limit", "4096")
    assert status == 2 and err.count("\n") == 1 and "--max-tokens-limit" in err, err


@pytest.mark.parametrize("args, words", [
    (["--parallel", "2", "--overflow", "rolling"], "--parallel 2 needs --overflow stop and no cache policy"),
    (["--parallel", "4", "--cache-policy", "h2o", "--cache-budget", "64"], "--parallel 4 needs --overflow stop"),
    (["--parallel", "0"], "0 must be at least 1"),
    (["--parallel", "many"], "'many' is not a whole number"),
])
def test_a_parallel_that_cannot_work_is_one_line_before_the_load(serve, args, words):
    status, _, err = serve(*args)
    assert status == 2 and err.count("\n") == 1 and words in err and "model.gguf" not in err, err


@pytest.mark.parametrize("args", [["--parallel", "auto"], ["--parallel", "AUTO", "--overflow", "rolling"],
                                  ["--overflow", "rolling"], ["--parallel", "3"], ["--pool-mib", "64"]])
def test_auto_parallel_and_one_that_can_work_are_accepted(serve, args):
    status, _, err = serve(*args)
    assert status == 2 and "model.gguf" in err and "--parallel" not in err, err  # the error is about the model
