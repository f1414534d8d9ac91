"""What ``attnchat serve`` refuses: foreign Host names (DNS rebinding), foreign
web pages (Origin), bodies that are not JSON (``attnchat.server.guard``), and requests
that would hold the only worker for hours.

The checks go through a real server on 127.0.0.1 (no API key, as the desktop's "Serve
over HTTP" runs it), with ``--allowed-host`` and ``--cors-origin`` to show each opening:
conftest's ``guarded_server``.
"""
from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import pytest

from attnchat.server.guard import HEADER_TIMEOUT_S, Guard, normalize_origin
from tests.server.conftest import EXTRA_HOST, PAGE


@pytest.fixture(scope="module")
def http(guarded_server):
    """Raw HTTP on the guarded server (no API key)."""
    with httpx.Client(base_url=guarded_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ask(http):
    model = http.get("/models").json()["data"][0]["id"]
    return json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})


def _refused(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err["message"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/models", "/attnchat/stats"])
def test_a_rebound_host_name_is_refused(http, path):
    message = _refused(http.get(path, headers={"Host": "evil.example"}), 403, "host_not_allowed")
    assert "'evil.example'" in message and "--allowed-host" in message
    _refused(http.get(path, headers={"Host": "evil.example:8000"}), 403, "host_not_allowed")


@pytest.mark.slow
def test_a_rebound_host_cannot_generate(http, ask):
    before = http.get("/attnchat/stats").json()["requests"]
    r = http.post("/chat/completions", content=ask, headers={"Host": "evil.example", "Content-Type": "application/json"})
    _refused(r, 403, "host_not_allowed")
    assert http.get("/attnchat/stats").json()["requests"] == before


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1234", "[::1]:80", "LOCALHOST", EXTRA_HOST, "chat.lan:9"])
def test_the_bound_and_allowed_hosts_are_answered(http, host):
    assert http.get("/models", headers={"Host": host}).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_json_gets_415(http, ask, ctype):
    before = http.get("/attnchat/stats").json()["requests"]
    headers = {"Content-Type": ctype} if ctype else {}
    req = http.build_request("POST", "/chat/completions", content=ask, headers=headers)
    assert req.headers.get("Content-Type") == ctype  # httpx adds none for raw bytes
    message = _refused(http.send(req), 415, "unsupported_media_type")
    assert "application/json" in message
    assert http.get("/attnchat/stats").json()["requests"] == before


@pytest.mark.slow
def test_json_with_a_charset_is_answered(http, ask):
    r = http.post("/chat/completions", content=ask, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:3001", "https://localhost:3000"])
def test_a_foreign_web_page_is_refused(http, ask, origin):
    message = _refused(http.post("/chat/completions", content=ask,
                                 headers={"Origin": origin, "Content-Type": "application/json"}),
                       403, "origin_not_allowed")
    assert "--cors-origin" in message
    r = http.get("/models", headers={"Origin": origin})
    _refused(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    preflight = http.options("/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers


@pytest.mark.slow
def test_an_allowed_origin_gets_cors(http, ask):
    preflight = http.options("/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    r = http.post("/chat/completions", content=ask, headers={"Origin": PAGE, "Content-Type": "application/json"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["vary"] == "Origin"
    # Even a trusted page may not send a body a form could send.
    r = http.post("/chat/completions", content=ask, headers={"Origin": PAGE, "Content-Type": "text/plain"})
    _refused(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("text, origin", [
    ("http://localhost:3000", "http://localhost:3000"), ("HTTPS://App.Example/", "https://app.example"),
    ("http://[::1]:8080", "http://[::1]:8080"),
])
def test_origins_are_normalized(text, origin):
    assert normalize_origin(text) == origin


@pytest.mark.parametrize("text", ["*", "localhost:3000", "http://x/path", "ftp://x", "null", "http://x?q=1", ""])
def test_what_is_not_an_origin_is_refused(text):
    with pytest.raises(ValueError, match="not a web origin"):
        normalize_origin(text)


def test_a_wildcard_bind_answers_ip_literals_but_not_names():
    guard = Guard(None, hosts=["0.0.0.0"])
    assert guard.host_allowed("192.168.1.5:8000") and guard.host_allowed("[fe80::1]:80")
    assert guard.host_allowed("localhost") and not guard.host_allowed("evil.example")
    loopback = Guard(None, hosts=["127.0.0.1"])
    assert not loopback.host_allowed("192.168.1.5") and not loopback.host_allowed("")


@pytest.mark.slow
def test_ten_thousand_messages_are_trimmed_not_a_freeze(http, ask):
    """A 340 KB body of 10,000 one-letter messages once held the worker for ~44 minutes."""
    model = json.loads(ask)["model"]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(10_001)]
    t0 = time.monotonic()
    r = http.post("/chat/completions", json={"model": model, "max_tokens": 1, "messages": msgs}, timeout=120)
    seconds = time.monotonic() - t0
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] <= 512 and body["attnchat"]["dropped_tokens"] > 60_000
    print(f"10,001 messages answered in {seconds:.2f} s")


@pytest.mark.slow
def test_half_sent_headers_are_cut_off(guarded_server):
    """A request whose headers never finish is cut off: it does not hold its connection for good."""
    host, port = guarded_server.base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 20) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert HEADER_TIMEOUT_S - 1 <= time.monotonic() - t0 < HEADER_TIMEOUT_S + 15
