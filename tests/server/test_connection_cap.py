"""``--max-connections`` holds its slots for the clients that use the server (else any local
user could hold all 64 with idle connections, and everyone would get 503 until they closed).

The rule (attnchat.server.guard.ConnectionCap): a connection arriving at the cap closes an
idle one, those without a valid key first; only when every connection has a request in
progress does the newcomer get 503 ``too_many_connections``. Runs ``attnchat serve``'s
uvicorn configuration (:func:`attnchat.server.command.server_config`) with a cap of 4 over a
small app in a thread (no model).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from attnchat.server.command import server_config

KEY = "sk-cap"
CAP = 4
#: /slow requests the app is answering now.
_in_progress = []


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    headers = dict(scope["headers"])
    status = 200 if headers.get(b"authorization") == f"Bearer {KEY}".encode() else 401
    if status == 200 and scope["path"] == "/slow":
        _in_progress.append(1)
        await asyncio.sleep(1.5)
        _in_progress.pop()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    s = uvicorn.Server(server_config(app, max_connections=CAP, api_key=KEY))
    thread = threading.Thread(target=s.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not s.started:
        time.sleep(0.02)
    yield sock.getsockname()[1]
    s.should_exit = True
    thread.join(10)
    sock.close()


def _connect(port: int) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    time.sleep(0.05)  # accepted and counted before the next one arrives
    return c


def _request(c: socket.socket, path: str = "/", key: str | None = KEY) -> None:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    c.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())


def _response(c: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(65536)
        if not chunk:
            return 0, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += c.recv(65536)
    return int(head.split()[1]), body


def _closed(c: socket.socket) -> bool:
    c.settimeout(0.5)
    try:
        return c.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_without_a_key_give_way_to_a_client_with_one(server):
    squatters = [_connect(server) for _ in range(CAP)]  # connected, never a byte sent
    client = _connect(server)
    _request(client)
    assert _response(client) == (200, b"ok")  # uvicorn's own cap answered 503 here
    closed = [_closed(s) for s in squatters]
    assert closed == [True, False, False, False]  # the oldest squatter made room


def test_keyed_connections_are_closed_last(server):
    keyed = [_connect(server) for _ in range(2)]
    for c in keyed:
        _request(c)
        assert _response(c) == (200, b"ok")  # idle now, keep-alive, with a valid key
    unkeyed = [_connect(server) for _ in range(2)]
    for c in unkeyed:
        _request(c, key="wrong")
        assert _response(c)[0] == 401  # idle now, no valid key
    newcomers = [_connect(server) for _ in range(2)]
    for c in newcomers:
        _request(c)
        assert _response(c) == (200, b"ok")
    assert [_closed(c) for c in unkeyed] == [True, True]
    assert [_closed(c) for c in keyed] == [False, False]
    third = _connect(server)  # now only keyed connections are idle: the least recently active goes
    _request(third)
    assert _response(third) == (200, b"ok")
    assert [_closed(c) for c in keyed] == [True, False]


def test_when_every_connection_is_busy_the_newcomer_gets_503(server):
    busy = [_connect(server) for _ in range(CAP)]
    for c in busy:
        _request(c, "/slow")
    deadline = time.monotonic() + 30
    while len(_in_progress) < CAP and time.monotonic() < deadline:  # every one has a request in progress
        time.sleep(0.01)
    late = _connect(server)
    _request(late)
    status, body = _response(late)
    assert status == 503
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert _closed(late)
    assert [_response(c) for c in busy] == [(200, b"ok")] * CAP  # none of them was cut
