"""A real ``attnchat serve`` process on a free loopback port, for tests (and
scripts/server_rss.py): start it, wait for its "serving ... at URL" line, stop it.

The shared server with an API key (the ``server`` fixture) is in tests/conftest.py, so
tests/server and tests/desktop/test_remote_engine.py use one process per session.
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
