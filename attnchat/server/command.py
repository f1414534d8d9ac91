"""``attnchat serve``: the OpenAI-compatible HTTP server (see :mod:`attnchat.server`).

``attnchat serve [--model SRC] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--parallel auto|N]``

It binds to loopback by default and refuses any other address without an API key.
The address is checked and bound before the model loads, so a mistake costs no wait.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from typing import Any

from attnchat import cache_options, model_options

DEFAULT_PORT = 8000
API_KEY_ENV = "ATTNCHAT_API_KEY"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks a free one)")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _parallel(text: str) -> int | None:
    """``auto`` (None: batching when it can work, :func:`attnchat.server.batching.plan`) or a count."""
    return None if text.strip().lower() == "auto" else _count(text)


def _origin(text: str) -> str:
    from attnchat.server.guard import normalize_origin

    try:
        return normalize_origin(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="GET /v1/models and POST /v1/chat/completions (streamed or not); several replies decode "
                    "together (continuous batching) where the settings and memory allow. "
                    "Binds to loopback unless given --host with --api-key.")
    model_options.add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV) or None,
                     help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none). Other users "
                          f"see a command line's arguments (ps): prefer ${API_KEY_ENV} or --api-key-file")
    key.add_argument("--api-key-file", metavar="PATH",
                     help="read API keys from PATH, one per line (keep it 0600); clients with different keys "
                          "never share a KV cache")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable; by default only "
                        "localhost, 127.0.0.1, ::1 and --host: a guard against DNS rebinding)")
    p.add_argument("--cors-origin", action="append", default=[], type=_origin, metavar="ORIGIN",
                   help="let web pages at ORIGIN (e.g. http://localhost:3000) call the API (repeatable; "
                        "by default requests from any web page are refused)")
    p.add_argument("--model-id", metavar="NAME", help="the model's id in the API (default: its file name)")
    p.add_argument("--max-tokens", type=_count, default=1024, metavar="N",
                   help="reply length for requests without max_tokens (default 1024)")
    p.add_argument("--max-tokens-limit", type=_count, default=4096, metavar="N",
                   help="the most tokens a request may ask for in max_tokens; more gets a 400 (default 4096)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="for requests without temperature (default 0 = greedy)")
    p.add_argument("--context", type=_count, default=None, metavar="N", help="context length in tokens (default: the model's maximum)")
    model_options.add_cache_dtype_arg(p)
    p.add_argument("--overflow", choices=["stop", "truncate-middle", "rolling"], default="stop",
                   help="when a conversation passes the context (default stop: a 400 context_length_exceeded, as OpenAI; API clients manage their own context)")
    cache_options.add_args(p)
    p.add_argument("--sessions", type=_count, default=4, metavar="N",
                   help="one at a time: conversations that keep their KV cache between requests (default 4); "
                        "batching keeps the pages of its last max(4, --parallel) finished replies instead")
    p.add_argument("--max-queued", type=_count, default=None, metavar="N",
                   help="requests that may wait behind the running ones; more get 429 with Retry-After "
                        "(default: one at a time 16; batching what memory allows, 64 to 1024)")
    p.add_argument("--parallel", type=_parallel, default=None, metavar="N",
                   help="replies decoding together in one step over a paged KV cache of --pool-mib (continuous "
                        "batching; needs --overflow stop and no cache policy); 1: one request at a time; "
                        "auto (default): 4 where the settings and free memory allow, else 1 (the startup line says why)")
    p.add_argument("--max-connections", type=_count, default=64, metavar="N",
                   help="open connections at most; a new one closes an idle one, one without a valid API key first, "
                        "and gets 503 only when every one has a request in progress (default 64)")
    p.add_argument("--pool-mib", type=_count, default=None, metavar="M",
                   help="batching: the KV pool's MiB (default: 256, or one whole conversation of the context "
                        "when more); one at a time: the MiB idle sessions may keep, least recently used freed "
                        "past it (default 256)")
    # engine.POOL_IDLE_S (not imported here: it imports torch; a test checks they agree)
    p.add_argument("--pool-idle-s", type=float, default=10.0, metavar="S",
                   help="seconds without a request after which the idle sessions' KV caches are freed and the memory "
                        "given back; 0: never (default 10)")
    model_options.add_run_args(p)
    p.set_defaults(func=run)
    return p


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: uvicorn listens on it).

    Raises:
        ValueError: the host does not resolve, or the port is taken or not allowed.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        raise ValueError(f"cannot resolve --host {host!r}; give an address such as 127.0.0.1") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                         "or stop what uses it") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _check_key_file(path: str) -> None:
    """Refuse a key file every user may read; warn (one line on stderr) for one its group may
    read (:func:`models.safety.check_key_file`).

    Raises:
        ValueError: world-readable or not a regular file (one line, for exit status 2).
    """
    from models import safety

    try:
        warning = safety.check_key_file(path)
    except safety.Refused as e:
        raise ValueError(str(e)) from None
    except OSError:
        return  # _read_key_file says why it cannot be read
    if warning:
        print(f"attnchat: warning: {warning}", file=sys.stderr)


def _read_key_file(path: str) -> list[str]:
    """The keys in ``path``: each non-empty line one key, stripped (clients with different
    keys never share a pooled KV cache).

    Raises:
        ValueError: the file cannot be read or holds no key (one line, for exit status 2).
    """
    try:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --api-key-file {path!r} ({getattr(e, 'strerror', None) or e}); "
                         "give a file holding one key per line") from None
    if not keys:
        raise ValueError(f"--api-key-file {path!r} holds no key; write one key per line")
    return keys


def run(args: argparse.Namespace) -> int:
    if args.api_key_file is not None:
        _check_key_file(args.api_key_file)
        args.api_key = _read_key_file(args.api_key_file)
    if args.max_tokens > args.max_tokens_limit:
        raise ValueError(f"--max-tokens {args.max_tokens} passes --max-tokens-limit {args.max_tokens_limit}; "
                         "lower the one or raise the other")
    if not is_loopback(args.host) and not args.api_key:
        raise ValueError(f"refusing to serve on {args.host} without an API key: anyone who can reach it could "
                         f"use it; add --api-key KEY (or set ${API_KEY_ENV}), or bind to 127.0.0.1")
    if isinstance(args.api_key, str) and not args.api_key.strip():
        raise ValueError("--api-key is empty; give a key, or leave it out on loopback")
    settings = _settings(args)  # check before the slow load
    if args.parallel is not None and args.parallel > 1 and (settings.overflow != "stop" or settings.cache_policy != "none"):
        raise ValueError(f"--parallel {args.parallel} needs --overflow stop and no cache policy; "
                         "drop --parallel (one request at a time) or those options")
    sock = bind(args.host, args.port)
    try:
        return _serve(args, settings, sock)
    finally:
        sock.close()


def _settings(args: argparse.Namespace):
    from runtime import GenerationSettings, SamplingParams

    SamplingParams(temperature=args.temperature)  # the same one-line error as `chat`
    if args.cache_dtype is not None:
        from runtime.dtypes import parse_cache_dtype

        parse_cache_dtype(args.cache_dtype)
    return GenerationSettings(context_limit=args.context, cache_dtype=args.cache_dtype, overflow=args.overflow,
                              **cache_options.settings(args))


def server_config(app: Any, *, max_connections: int, api_key: str | list[str] | None):
    """uvicorn's configuration for ``app``: log records to attnchat's log file (not the
    terminal), and the connection cap (``--max-connections``): a newcomer at the cap closes
    an idle connection, one without a valid key first (:class:`attnchat.server.guard.ConnectionCap`;
    uvicorn's ``limit_concurrency`` would answer 503 to everyone once anyone holds the
    slots); half-sent requests hold a connection only until ``HEADER_TIMEOUT_S``."""
    import uvicorn

    from attnchat.server.guard import capped

    return uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=3, lifespan="on",
                          http=capped(max_connections, api_key))


def _serve(args: argparse.Namespace, settings, sock: socket.socket) -> int:
    import asyncio

    import uvicorn

    from attnchat.server.app import create_app
    from attnchat.fetching import model_source
    from attnchat.server.batching import plan
    from attnchat.server.guard import drop_query_strings
    from runtime import load_model

    model = load_model(model_source(args.model), device=args.device, dtype=args.dtype, reproducible=args.reproducible)
    how = plan(model, settings, parallel=args.parallel, max_queued=args.max_queued,
               pool_bytes=None if args.pool_mib is None else args.pool_mib << 20)
    logging.getLogger("attnchat.serve").info("%s", how.reason)
    print(f"attnchat: {how.reason}", flush=True)
    app = create_app(model, api_key=args.api_key, model_id=args.model_id, settings=settings,
                     sessions=args.sessions, default_temperature=args.temperature,
                     default_max_tokens=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
                     max_queued=how.max_queued, parallel=how.parallel,
                     allowed_hosts=[args.host, *args.allowed_host],
                     cors_origins=args.cors_origin, pool_bytes=how.pool_bytes,
                     pool_idle_s=args.pool_idle_s)
    config = server_config(app, max_connections=args.max_connections, api_key=args.api_key)
    logging.getLogger("uvicorn.access").addFilter(drop_query_strings)
    server = stopping_server(config, app.state.engine)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"attnchat: serving {app.state.model_id} on {model.device} at {_url(sock)} "
                  f"({'API key required' if args.api_key else 'no API key'}); Ctrl-C stops", flush=True)
        await task

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        # uvicorn raises the Ctrl-C again once it has shut down: the stop the banner offers
        if not (server.started and server.should_exit):
            raise
    if not server.started:
        print("attnchat: error: the server did not start; see the log file", file=sys.stderr)
        return 1
    return 0


def stopping_server(config: Any, engine: Any):
    """A ``uvicorn.Server`` for ``config`` that, told to stop (Ctrl-C, SIGTERM), first ends the
    ``engine``'s replies in progress (each stream gets its finish chunk and ``[DONE]``: see
    :mod:`attnchat.server.relay`) and says so in one line, then shuts down as uvicorn does.
    uvicorn alone waited ``timeout_graceful_shutdown`` for the streams, then cut them."""
    import asyncio

    import uvicorn

    class StoppingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            stats = engine.stats()
            n = int(stats.get("running", stats.get("busy", 0))) + int(stats.get("queued", 0))
            ending = f"; {n} repl{'y' if n == 1 else 'ies'} in progress end{'s' if n == 1 else ''} here" if n else ""
            print(f"attnchat: stopping{ending}", flush=True)
            await asyncio.to_thread(engine.close)  # the event loop sends the streams' last chunks meanwhile
            await super().shutdown(sockets)
            # here, not after the server returns: uvicorn then raises a SIGTERM again (exit 143)
            print("attnchat: stopped", flush=True)

    return StoppingServer(config)
