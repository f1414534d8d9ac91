"""Fixtures for the server tests: a real ``attnchat serve`` process on a free loopback port.

The server loads the real default model (seconds), so two session-scoped servers serve
every test here: :func:`server` (with an API key) and :func:`guarded_server` (the
security and pool-memory configuration). It runs on the CPU in float32: a greedy reply
is then the same whether its prompt was prefilled whole or partly reused from the KV
cache, so tests sharing a server do not change each other's answers.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

API_KEY = "test-key-123"
#: Loading the model on a busy two-core machine can take a while.
START_TIMEOUT_S = 180


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    api_key: str | None
    output: list[str]


def serve_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ATTNCHAT_API_KEY", None)
    return env


def start_server(*args: str) -> Server:
    """Start ``attnchat serve --port 0 ARGS`` and wait for its "serving ... at URL" line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnchat", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=serve_env())
    output: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # keeps the pipe drained for the server's whole life
        for line in proc.stdout:
            output.append(line)
            if " at http://" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("attnchat serve did not start:\n" + "".join(output))
    url = re.search(r"at (http://\S+/v1)", "".join(output)).group(1)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    return Server(proc, url, key, output)


def stop_server(server: Server) -> None:
    server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="session")
def server(default_model_file: Path):
    """One server with an API key, a 2048-token context and two pooled sessions, shared by
    every module that needs no special configuration (starting one costs ~15 s and ~5 s to
    stop on the two-core test machine). Tests that count must count differences."""
    s = start_server("--model", str(default_model_file), "--api-key", API_KEY, "--context", "2048",
                     "--sessions", "2", "--device", "cpu")
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official client on :func:`server`."""
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def http(server):
    """Raw HTTP on :func:`server`'s ``/v1``, with the API key."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


#: Names and origins :func:`guarded_server` answers besides loopback.
EXTRA_HOST = "chat.lan"
PAGE = "http://localhost:3000"


@pytest.fixture(scope="session")
def guarded_server(default_model_file: Path):
    """The second configuration (test_security, test_metrics_and_memory): no API key, a
    512-token context, one extra host name and web origin, overflow ``truncate-middle``
    (the 10,000-message test checks trimming) and a pool of at most 1 MiB of idle KV cache
    (~22 tokens of the default model, so every reply's cache is freed when it ends)."""
    s = start_server("--model", str(default_model_file), "--context", "512", "--device", "cpu",
                     "--allowed-host", EXTRA_HOST, "--cors-origin", PAGE, "--overflow", "truncate-middle",
                     "--pool-mib", "1")
    yield s
    stop_server(s)
