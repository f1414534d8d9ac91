"""The HTTP app: :func:`create_app` builds the engine for a model and the FastAPI app
around it (its routes, its middleware, its error handlers). The generation routes live in
:mod:`attnchat.server.routes`. Must not import Qt.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnchat.server import routes, tools
from attnchat.server.batching import MAX_QUEUED as BATCH_QUEUED
from attnchat.server.batching import BatchEngine
from attnchat.server.engine import MAX_QUEUED, POOL_BYTES, POOL_IDLE_S, Engine
from attnchat.server.errors import (
    APIError,
    from_validation,
    http_error,
    internal_error,
    no_model,
)
from attnchat.server.guard import Guard, normalize_origin
from attnchat.server.metrics import CONTENT_TYPE as METRICS_TYPE
from attnchat.server.metrics import CountRequests, Metrics
from attnchat.server.request import MAX_BODY_BYTES
from models.catalog import CATALOG
from runtime import GenerationSettings, Model

log = logging.getLogger("attnchat.serve")


def create_app(model: Model, *, api_key: str | Sequence[str] | None = None, model_id: str | None = None,
               settings: GenerationSettings | None = None, sessions: int = 4,
               default_temperature: float = 0.0, default_max_tokens: int = 1024, max_tokens_limit: int = 4096,
               max_body_bytes: int = MAX_BODY_BYTES, max_queued: int | None = None, allowed_hosts: Sequence[str] = (),
               cors_origins: Sequence[str] = (), pool_bytes: int = POOL_BYTES,
               pool_idle_s: float | None = POOL_IDLE_S, parallel: int = 1) -> FastAPI:
    """The HTTP app serving ``model``.

    Args:
        model: the loaded model; one engine thread runs it.
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``; a
            list of keys takes any of them, and clients with different keys never share
            a pooled KV cache (:mod:`attnchat.server.engine`).
        model_id: the id clients name in ``model`` (default: the model's name).
        settings: the sessions' context, cache dtype and overflow policy (default: the
            model's context, overflow ``stop``).
        sessions: conversations that keep their KV cache between requests.
        default_temperature: for requests without ``temperature`` (0 = greedy, as ``attnchat chat``).
        default_max_tokens: for requests without ``max_tokens`` (tokens).
        max_tokens_limit: the most a request may ask for (tokens); more is a 400, so one
            request cannot hold the only worker for a whole context's worth of decoding.
        max_body_bytes: largest request body (bytes).
        max_queued: requests that may wait behind the running ones; more get 429 (default:
            16 one at a time, 64 with ``parallel``: :data:`attnchat.server.batching.MAX_QUEUED`).
        allowed_hosts: ``Host`` names answered besides the loopback names (the bound
            address, ``--allowed-host``); see :mod:`attnchat.server.guard`.
        cors_origins: web origins whose pages may call the API (``--cors-origin``).
        pool_bytes: KV-cache bytes idle pooled sessions may keep (``--pool-mib``).
        pool_idle_s: seconds without a request after which the pooled caches are freed
            (``--pool-idle-s``; 0 or None: never).
        parallel: replies decoding together (``--parallel``); above 1 the batching engine
            (:mod:`attnchat.server.batching`) runs them over a paged KV cache of ``pool_bytes``.

    Raises:
        ValueError: settings the model cannot take (a context past its maximum, ...),
            an entry of ``cors_origins`` that is not an origin.
    """
    cors_origins = [normalize_origin(o) for o in cors_origins]  # a bad one fails here, not per request
    model_id = model_id or model.name
    # Names a request may use for the model, compared case-insensitively: its id, its file
    # name and, for a catalog model, the catalog's id and name.
    aliases = {model_id.lower(), model.name.lower(), model.path.name.lower()}
    aliases |= {n.lower() for e in CATALOG if e.filename == model.path.name for n in (e.id, e.name)}
    # API clients manage their own context: by default a conversation too long is refused
    # (400, as OpenAI), never cut silently.
    metrics = Metrics(lambda: {k: float(v) for k, v in engine.stats().items() if k != "last"
                               and isinstance(v, (int, float))})
    settings = settings or GenerationSettings(overflow="stop")
    if parallel > 1:
        engine = BatchEngine(model, settings=settings, parallel=parallel,
                             max_queued=BATCH_QUEUED if max_queued is None else max_queued, pool_bytes=pool_bytes, pool_idle_s=pool_idle_s, on_reply=metrics.reply)
    else:
        engine = Engine(model, settings=settings, sessions=sessions,
                        max_queued=MAX_QUEUED if max_queued is None else max_queued, pool_bytes=pool_bytes, pool_idle_s=pool_idle_s, on_reply=metrics.reply)
    created = int(time.time())
    # Tools through the model's own template where it renders them, else the fallback
    # prompt (see attnchat.server.tools); decided once, by rendering, before the engine runs.
    template_tools = tools.template_renders_tools(model.tokenizer)
    log.info("tools are described by %s", "the model's chat template" if template_tools else "the fallback prompt")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="attnchat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.model_id = model_id

    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])

    def authorize(request: Request) -> None:
        """Checks the key; notes which one (``request.state.partition``: the caches its
        requests may share) for the routes."""
        request.state.partition = ""
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # every key compared, in constant time each: which one matched is not timed
        matched = [i for i, k in enumerate(keys) if hmac.compare_digest(given, k.encode())]
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        request.state.partition = f"key{matched[0]}"

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "attnchat",
                "context_length": engine.context_limit}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_TYPE)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        if name.lower() not in aliases:
            raise no_model(name, model_id)
        return model_card()

    @v1.get("/attnchat/stats")
    async def stats() -> dict[str, Any]:
        return {"model": model_id, "device": str(model.device), "context_limit": engine.context_limit,
                "tool_prompt": "template" if template_tools else "fallback", **engine.stats()}

    serving = routes.Serving(model, model_id, engine, frozenset(aliases), template_tools, default_temperature,
                             default_max_tokens, max_tokens_limit, max_body_bytes)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routes.chat_completions(serving, request)

    @v1.post("/completions")
    async def text_completions(request: Request) -> Response:
        return await routes.text_completions(serving, request)

    app.include_router(v1)
    app.add_middleware(CountRequests, requests=metrics.requests)
    app.add_middleware(Guard, hosts=allowed_hosts, cors_origins=cors_origins)  # the outermost
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError,
                              lambda request, e: from_validation(list(e.errors())).response())
    app.add_exception_handler(Exception, internal_error)
    return app
