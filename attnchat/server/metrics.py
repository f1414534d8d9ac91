"""``GET /metrics``: the server's figures in Prometheus' text format (prometheus_client).

One registry per app (never the process-global one), so two apps in one process (the
tests) keep their own counts. Requests, tokens, finish reasons, TTFT and decode speed
histograms are recorded as replies end; queue depth and KV-cache bytes are read from
the engine when scraped. Must not import Qt.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

#: Prometheus' text exposition format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The server's Prometheus metrics.

    Args:
        gauges: called at each scrape; returns ``{"queued": n, "busy": 0|1, "sessions": n,
            "kv_used_bytes": n, "kv_allocated_bytes": n}`` (the engine's state now).
    """

    def __init__(self, gauges: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("attnchat_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.replies = Counter("attnchat_replies", "Replies ended, by finish reason", ["finish_reason"],
                               registry=self.registry)
        self.prompt_tokens = Counter("attnchat_prompt_tokens", "Prompt tokens (after the overflow policy)",
                                     registry=self.registry)
        self.cached_tokens = Counter("attnchat_cached_prompt_tokens", "Prompt tokens reused from the KV cache",
                                     registry=self.registry)
        self.completion_tokens = Counter("attnchat_completion_tokens", "Generated tokens", registry=self.registry)
        self.ttft = Histogram("attnchat_time_to_first_token_seconds", "Time to first token (seconds)",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.decode_speed = Histogram("attnchat_decode_tokens_per_second", "Decode speed of a reply (tokens/s)",
                                      buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320), registry=self.registry)
        self.registry.register(_Gauges(gauges))

    def reply(self, reason: str, stats: Any) -> None:
        """Record a reply that ended (``stats``: its :class:`runtime.TurnStats`)."""
        self.replies.labels(reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.reused_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.completion_tokens > 1:
            self.decode_speed.observe(stats.decode_tokens_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    """Reads the engine's state at scrape time."""

    HELP = {"queued": "Requests waiting for the engine", "busy": "1 while a reply is being generated",
            "sessions": "Pooled sessions (conversations that keep a KV cache)",
            "kv_used_bytes": "KV-cache bytes holding tokens, all pooled sessions",
            "kv_allocated_bytes": "KV-cache bytes allocated, all pooled sessions"}

    def __init__(self, read: Callable[[], dict[str, float]]):
        self.read = read

    def describe(self):
        return [GaugeMetricFamily(f"attnchat_{k}", h) for k, h in self.HELP.items()]

    def collect(self):
        values = self.read()
        for k, h in self.HELP.items():
            yield GaugeMetricFamily(f"attnchat_{k}", h, value=float(values.get(k, 0)))


class CountRequests:
    """ASGI middleware that counts each HTTP response in ``requests`` by route and status.

    A plain ASGI class, not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
    wraps ``receive`` so that ``Request.is_disconnected()`` never sees the client leave,
    and a non-streamed request whose client hung up then ran to its end.

    Args:
        app: the ASGI app behind it.
        requests: the ``attnchat_requests`` counter (labels ``endpoint``, ``status``).
    """

    def __init__(self, app: Any, requests: Counter):
        self.app, self.requests = app, requests

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = "500"  # an exception past this point becomes a 500 further out

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router records the matched route in the (shared) scope.
            self.requests.labels(getattr(scope.get("route"), "path", "unknown"), status).inc()
