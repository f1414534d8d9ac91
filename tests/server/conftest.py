"""Fixtures for the server tests: real ``attnchat serve`` processes (tests/live_server.py).

The server loads the real default model (seconds), so two session-scoped servers serve
every test here: ``server`` (with an API key; in tests/conftest.py, shared with
tests/desktop/test_remote_engine.py) and :func:`guarded_server` (the security and
pool-memory configuration). It runs on the CPU in float32: a greedy reply
is then the same whether its prompt was prefilled whole or partly reused from the KV
cache, so tests sharing a server do not change each other's answers.
"""
from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.live_server import API_KEY, start_server, stop_server


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official client on the shared ``server`` (tests/conftest.py)."""
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def http(server):
    """Raw HTTP on the shared ``server``'s ``/v1``, with the API key."""
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
