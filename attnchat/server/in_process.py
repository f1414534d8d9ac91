"""The HTTP server for a model this process has already loaded, on a thread of its own.

``attnchat serve`` loads its own copy of the weights in its own process. :class:`InProcessServer`
serves a :class:`runtime.Model` that is already in memory (the desktop window's, for its serve
toggle): the server's engine runs on its own thread over the same weights, so serving costs
no second copy of them and no second load. The chat and the server then take turns at the
model's kernels (the ggml graphs serve one compute at a time); each conversation keeps its own
KV cache, so neither changes the other's replies.

Loopback by default; the same app as ``attnchat serve`` (:func:`attnchat.server.app.create_app`),
with batching as :func:`attnchat.server.batching.plan` decides. uvicorn installs no signal
handlers off the main thread: :meth:`InProcessServer.stop` is the stop. Must not import Qt.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Sequence

from runtime import GenerationSettings, Model

__all__ = ["InProcessServer", "for_window"]

log = logging.getLogger("attnchat.serve")

#: Seconds :meth:`InProcessServer.start` waits for the server to listen.
START_TIMEOUT_S = 30.0


class InProcessServer:
    """``model`` served over HTTP from this process (one uvicorn server on one thread).

    Args:
        model: the loaded model; the server's engine uses this object (its weights are not copied).
        host: the address to bind (a non-loopback one needs ``api_key``).
        port: the port (0: a free one, read back in :attr:`url`).
        api_key: a key (or keys) every ``/v1`` request must send as ``Bearer``.
        settings: the server's context, cache dtype, overflow (default: overflow ``stop``).
        parallel: replies decoding together (None: :func:`attnchat.server.batching.plan`'s choice).
        max_connections: open connections at most (``serve --max-connections``).
        **app_options: the rest of :func:`attnchat.server.app.create_app`'s options.

    Raises:
        ValueError: a non-loopback ``host`` without a key, settings the model cannot take,
            an asked ``parallel`` that cannot work.
        OSError: the address cannot be bound.
    """

    def __init__(self, model: Model, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | Sequence[str] | None = None, settings: GenerationSettings | None = None,
                 parallel: int | None = None, max_connections: int = 64, **app_options: Any):
        import uvicorn

        from attnchat.server.app import create_app
        from attnchat.server.batching import plan
        from attnchat.server.command import bind, is_loopback, server_config

        if not is_loopback(host) and not api_key:
            raise ValueError(f"refusing to serve on {host} without an API key: anyone who can reach it could use it")
        settings = settings or GenerationSettings(overflow="stop")
        how = plan(model, settings, parallel=parallel)
        log.info("in-process server: %s", how.reason)
        #: Why it batches or not, in words (``plan``'s reason).
        self.reason = how.reason
        self.model = model
        self._sock = bind(host, port)
        try:
            self.app = create_app(model, api_key=api_key, settings=settings, parallel=how.parallel,
                                  max_queued=how.max_queued, pool_bytes=how.pool_bytes,
                                  allowed_hosts=[host, *app_options.pop("allowed_hosts", ())],
                                  **app_options)
            self._server = uvicorn.Server(server_config(self.app, max_connections=max_connections, api_key=api_key))
        except BaseException:
            self._sock.close()
            raise
        name, bound_port = self._sock.getsockname()[:2]
        #: The API's base address, ``http://HOST:PORT/v1``.
        self.url = f"http://{'[' + name + ']' if ':' in name else name}:{bound_port}/v1"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def engine(self) -> Any:
        """The server's engine (:class:`attnchat.server.engine.Engine` or ``BatchEngine``)."""
        return self.app.state.engine

    @property
    def serving(self) -> bool:
        """True from a successful :meth:`start` until :meth:`stop` (or the server's failure)."""
        return self._thread is not None and self._thread.is_alive() and self._server.started

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Starts serving; returns :attr:`url` once the server listens.

        Raises:
            RuntimeError: started twice, or the server failed or did not listen within
                ``timeout`` seconds (it is stopped then).
        """
        if self._thread is not None:
            raise RuntimeError("this server was started already; make a new InProcessServer")
        self._thread = threading.Thread(target=self._run, name="attnchat-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"the server did not start: {self._error or 'timed out'}")
        log.info("serving %s at %s from this process", self.app.state.model_id, self.url)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the replies in progress (each stream gets its finish chunk), then stops the server
        and closes its socket; returns once its thread has ended (or after ``timeout`` seconds).
        Safe to call twice or before :meth:`start`."""
        if self._thread is not None and self._thread.is_alive():
            self.engine.close()  # the server's event loop sends the streams' last chunks meanwhile
            self._server.should_exit = True
            self._thread.join(timeout)
        self._sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as e:  # said by start(); the thread must not print a traceback
            self._error = e
            log.exception("the in-process server failed")



def for_window(model: Model, *, port: int = 0, api_key: str = "", options: dict | None = None) -> InProcessServer:
    """The desktop's Server > Serve the loaded model: ``model`` (the window's own) served on loopback
    ``port`` (0: a free one) with the window's settings, not yet started (:meth:`InProcessServer.start`).

    ``options`` are the window's serve settings as :func:`desktop.remote.serve_toggle.serve_command`
    takes them: ``context`` (tokens; 0: the model's maximum), ``cache_dtype`` (``"auto"``: the
    model's), ``cache_policy`` and its ``cache_budget`` (``"512"`` tokens or ``"24MiB"``). The weight
    dtype and the reproducible mode are the loaded model's own. The overflow policy is the server's
    (stop: API clients manage their context), as for ``attnchat serve``.

    Raises:
        ValueError: settings the model cannot take, a budget that does not parse, or the port
            taken (one line; "pick another --port" in it, as ``attnchat serve`` says).
    """
    from attnchat.cache_options import parse_budget

    o = options or {}
    policy = str(o.get("cache_policy") or "none")
    tokens, nbytes = parse_budget(str(o["cache_budget"])) if policy != "none" and o.get("cache_budget") else (None, None)
    cache = str(o.get("cache_dtype") or "auto")
    settings = GenerationSettings(context_limit=int(o.get("context") or 0) or None,
                                  cache_dtype=None if cache == "auto" else cache, overflow="stop",
                                  cache_policy=policy, cache_budget=tokens, cache_budget_bytes=nbytes)
    return InProcessServer(model, host="127.0.0.1", port=int(port or 0), api_key=api_key or None, settings=settings)
