"""What the HTTP server refuses before a request reaches its routes: foreign hosts, foreign
web pages and bodies that are not JSON. Must not import Qt, torch or runtime.

A pure ASGI middleware (:class:`Guard`), because every refusal must come back in
OpenAI's error shape and before the body is read; Starlette's ``TrustedHostMiddleware``
(plain-text 400) and ``CORSMiddleware`` (it leaves a foreign simple request to run and
only withholds the CORS headers) do neither.

- **Host** (DNS rebinding, the class of Ollama's CVE-2024-28224): a web page whose DNS
  name is re-pointed at 127.0.0.1 reaches this server as same-origin, but its requests
  carry ``Host: <the page's name>``. Only the names the server is bound to are answered
  (``localhost``, ``127.0.0.1``, ``::1``, the ``--host`` given, any port), plus each
  ``--allowed-host``. Bound to a wildcard address (``0.0.0.0``, ``::``), any IP literal is
  answered too: rebinding needs a DNS name, and clients on the network address the
  machine by its IP.
- **Origin** (cross-site requests): a browser names the page that sent a request in
  ``Origin``; one from another origin is refused (403) unless ``--cors-origin`` names
  it. For an allowed origin the response carries the CORS headers and a preflight
  (``OPTIONS`` with ``Access-Control-Request-Method``) is answered (204).
- **Content-Type**: a POST (PUT, PATCH, DELETE) must say ``application/json``; 415
  otherwise. ``text/plain`` and form bodies are what a web page may send to any site
  without a preflight, so accepting them would let any page run a generation.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from typing import Any, Awaitable, Callable, Iterable, Sequence
from urllib.parse import urlsplit

from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Host names every server answers to: the loopback names.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: Methods whose body must be JSON.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: How long a browser may cache a preflight answer (seconds).
PREFLIGHT_MAX_AGE_S = 600
#: A request's headers must arrive within this many seconds of the connection (or of the
#: previous response): 200 half-sent requests once held 200 connections open for good.
HEADER_TIMEOUT_S = 10.0


def _strip_port(host: str) -> str:
    """``host`` as a bare, lower-case name: ``[::1]:8000`` -> ``::1``, ``Example:80`` -> ``example``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host  # a bare IPv6 address (no brackets, no port) or a name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def normalize_origin(text: str) -> str:
    """``scheme://host[:port]`` in lower case, as browsers send ``Origin``.

    Raises:
        ValueError: ``text`` is not an origin (no scheme or host, or a path, query or ``*``).
    """
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username):
        raise ValueError(f"{text!r} is not a web origin; give one like http://localhost:3000 "
                         "(scheme, host and port, no path)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


#: Most bytes of a refused request's body read (and dropped) before answering.
_DRAIN_LIMIT = 1 << 20


async def _drain(receive: Receive) -> None:
    """Read and drop the request's body (up to :data:`_DRAIN_LIMIT` bytes) before a refusal:
    answering while the client is still sending makes the connection close under it, and
    the client sees a reset instead of the 4xx."""
    seen = 0
    while seen <= _DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class Guard:
    """ASGI middleware that refuses foreign hosts and origins and non-JSON bodies.

    Args:
        app: the ASGI app behind it.
        hosts: names the server answers to besides :data:`LOOPBACK_HOSTS` (the bound
            ``--host`` and each ``--allowed-host``; a port, if given, is ignored).
        cors_origins: web origins (``http://localhost:3000``) whose pages may call the API.

    Raises:
        ValueError: an entry of ``cors_origins`` that is not an origin.
    """

    def __init__(self, app: Any, *, hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()):
        self.app = app
        self.hosts = {_strip_port(h) for h in (*LOOPBACK_HOSTS, *hosts) if h.strip()}
        self.any_ip = bool(self.hosts & {"0.0.0.0", "::"})
        self.origins = {normalize_origin(o) for o in cors_origins}

    def host_allowed(self, host: str) -> bool:
        name = _strip_port(host)
        return name in self.hosts or (self.any_ip and _is_ip(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        host = headers.get("host", "")
        if not self.host_allowed(host):
            await _drain(receive)
            await _refuse(send, 403, f"This server does not answer to the host name {host!r}; connect to it "
                                     "at 127.0.0.1 or localhost, or start it with --allowed-host NAME.",
                          "host_not_allowed")
            return
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not self._origin_allowed(origin, scope, host):
                await _drain(receive)
                await _refuse(send, 403, f"Requests from web pages at {origin!r} are refused; start the server "
                                         f"with --cors-origin {origin} to let that page use it.",
                              "origin_not_allowed")
                return
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                asked = headers.get("access-control-request-headers", "")
                await _respond(send, 204, b"", cors + [
                    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                    # The origin is trusted: whatever headers its client sends (Authorization,
                    # the OpenAI SDK's x-stainless-* ...) may come.
                    (b"access-control-allow-headers", asked.encode("latin-1")),
                    (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
                ])
                return
        if method in BODY_METHODS:
            media = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != "application/json":
                got = f"'{media}'" if media else "none"
                await _drain(receive)
                await _refuse(send, 415, f"The request body must be JSON with 'Content-Type: application/json' "
                                         f"(got {got}).", "unsupported_media_type", cors)
                return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _origin_allowed(self, origin: str, scope: Scope, host: str) -> bool:
        try:
            normal = normalize_origin(origin)
        except ValueError:  # "null" (a file or sandboxed page) and other oddities
            return False
        # Same origin: a page served from this very address (the Host is checked already).
        own = f"{scope.get('scheme', 'http')}://{host.strip().lower()}"
        return normal in self.origins or normal == own


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _refuse(send: Send, status: int, message: str, code: str,
                  headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An error in OpenAI's shape (as :class:`attnchat.server.APIError` writes it)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    # The body was not read: close the connection rather than parse what follows it.
    await _respond(send, status, body, [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        *headers])


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (``uvicorn.Config(http=HeaderDeadline)``) that closes a
    connection whose request headers have not all arrived within :data:`HEADER_TIMEOUT_S`.

    uvicorn (0.54) times out only idle keep-alive connections; a client that sends its
    headers a byte at a time holds a connection (a file) for ever. The body has its own
    limit (``attnchat.server.BODY_TIMEOUT_S``).
    """

    _deadline: asyncio.TimerHandle | None = None
    _waiting_from: Any = None

    def _arm(self) -> None:
        self._disarm()
        self._waiting_from = self.cycle  # a new cycle object = the next request's headers came
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.cycle is not self._waiting_from:
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before: a pipelined request is handled inside, and disarms it
        super().on_response_complete()
        if self.transport.is_closing():
            self._disarm()


class ConnectionCap(HeaderDeadline):
    """:class:`HeaderDeadline` that caps open connections at :attr:`max_connections`, holding
    the slots for the clients that use the server rather than for whoever opened the most
    connections (64 idle connections without a key would otherwise shut everyone out).

    The rule: a connection that arrives at the cap closes an idle one (no request in
    progress) to take its place, choosing first among those whose last request carried no
    valid API key (or that never sent one), oldest activity first, then among the keyed
    ones, least recently active first. A request in progress is never cut. When every
    connection has a request in progress, the newcomer's request is answered 503
    (``too_many_connections``, in OpenAI's error shape) and its connection closed. Without
    an API key, any complete request counts as keyed. Configure with :func:`capped`;
    uvicorn's own ``limit_concurrency`` (it answers 503 once the cap is reached, whoever
    holds the slots) stays off.
    """

    max_connections = 64
    api_key: tuple[bytes, ...] | None = None  # any of these keys
    _authorized = False
    _active_at = 0.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._active_at = self.loop.time()
        live = [c for c in self.connections if not c.transport.is_closing()]
        if len(live) <= self.max_connections:
            return
        idle = [c for c in live if c is not self and isinstance(c, ConnectionCap) and c._idle()]
        if idle:
            victim = min(idle, key=lambda c: (c._authorized, c._active_at))
            victim.transport.close()
        else:
            self.app = _too_many_connections  # answered at its request (a reply before it may be lost)

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._active_at = self.loop.time()
            self._authorized = self.api_key is None or _has_key(self.headers, self.api_key)

    def on_response_complete(self) -> None:
        self._active_at = self.loop.time()
        super().on_response_complete()


def _has_key(headers: list[tuple[bytes, bytes]], keys: tuple[bytes, ...]) -> bool:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            # every key compared, each in constant time
            matched = [hmac.compare_digest(token.strip(), key) for key in keys]
            return scheme.lower() == b"bearer" and any(matched)
    return False


def capped(max_connections: int, api_key: str | Sequence[str] | None) -> type[ConnectionCap]:
    """The protocol class for ``uvicorn.Config(http=...)``: :class:`ConnectionCap` with this
    cap and key (or keys: any of them)."""
    keys = None if api_key is None else tuple(k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key))
    return type("ConnectionCap", (ConnectionCap,), {"max_connections": max_connections, "api_key": keys})


async def _too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await _drain(receive)
    body = json.dumps({"error": {"message": "The server has as many connections open as it takes "
                                            "(--max-connections), each with a request in progress; try again shortly.",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    await _respond(send, 503, body, [(b"content-type", b"application/json"), (b"connection", b"close"),
                                     (b"retry-after", b"1")])


def drop_query_strings(record: logging.LogRecord) -> bool:
    """A ``logging`` filter for uvicorn's access log: the path without its query string.

    A client that puts its API key in the URL (``?api_key=...``) must not find it in the
    log file. uvicorn's access record has ``args = (client, method, path, version, status)``.
    """
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
        record.args = (*args[:2], args[2].partition("?")[0], *args[3:])
    return True
