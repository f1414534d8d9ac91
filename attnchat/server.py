"""An OpenAI-compatible HTTP API over the engine: ``/v1/models`` and ``/v1/chat/completions``.

FastAPI on uvicorn. The event loop never runs the model: each request becomes a
:class:`attnchat.serve_engine.Job` for the engine's single worker thread, whose replies
come back through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue`` per request.
Streamed replies are server-sent events in OpenAI's ``chat.completion.chunk`` format.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status OpenAI would use: 400 bad values (and ``context_length_exceeded``), 401 a
bad or missing API key, 404 unknown routes and models, 405, 413 a body over the limit,
500 a bug. Must not import Qt.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnchat.serve_engine import MAX_QUEUED, Delta, Done, Engine, Failed, Item, Job, QueueFullError, Started
from attnchat.server_guard import Guard, normalize_origin
from models.catalog import CATALOG
from runtime import ContextOverflowError, GenerationSettings, Message, Model, SamplingParams

log = logging.getLogger("attnchat.serve")

#: Largest request body (bytes); a longer one gets 413. 1 MiB holds far more text than
#: the default model's 8192-token context.
MAX_BODY_BYTES = 1 << 20
#: A body over the limit is still read (and dropped) up to this size, so the client can
#: read the 413 instead of seeing its upload cut off.
DRAIN_BYTES = 16 << 20
#: How often a waiting request checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.25
#: A request body must arrive within this many seconds (408 after): a client that sends
#: a few bytes a minute must not hold a connection and a task for ever.
BODY_TIMEOUT_S = 30.0
#: What a 429 (the queue is full) suggests waiting before trying again (seconds).
RETRY_AFTER_S = 5
#: OpenAI accepts at most 4 stop sequences.
MAX_STOP = 4
#: Session finish reasons -> OpenAI's ("context": the reply ran out of room).
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# ---- errors -----------------------------------------------------------------------------
class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``messages[0].content``."""
    if not loc:
        return None
    name = str(loc[0])
    if name == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        name += f"[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ("role", "content"):
            name += f".{loc[2]}"
    return name


def _from_validation(errors: list[dict[str, Any]]) -> APIError:
    e = errors[0]
    kind, loc = e.get("type", ""), tuple(x for x in e.get("loc", ()) if x != "body")
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request ({e['msg']}); "
                             "send a JSON object (see https://platform.openai.com/docs/api-reference).")
    if not loc:
        return APIError(400, "The request body must be a JSON object.", code="invalid_type")
    param = _param(loc)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"Invalid value for '{param}': {e['msg'][:1].lower() + e['msg'][1:]} (got {got}).",
                     param=param, code=code)


# ---- the request ------------------------------------------------------------------------
class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[_Part] | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request we honour (others are ignored).

    ``top_k``, ``min_p`` and ``repetition_penalty`` are extensions (as in llama.cpp and vLLM).
    """

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    messages: list[_Message]
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _text(msg: _Message, i: int) -> str:
    if msg.content is None:
        if msg.role == "assistant":
            return ""
        raise APIError(400, f"messages[{i}] has no content.", param=f"messages[{i}].content", code="invalid_value")
    if isinstance(msg.content, str):
        return msg.content
    texts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}] has a '{part.type}' content part; this server reads text only.",
                           param=f"messages[{i}].content", code="invalid_value")
        texts.append(part.text)
    return "".join(texts)


def _conversation(req: ChatRequest) -> tuple[str | None, list[Message], str]:
    """(system prompt, history, last user text), or :class:`APIError` for a bad conversation."""
    if not req.messages:
        raise APIError(400, "'messages' must hold at least one message.", param="messages", code="invalid_value")
    msgs = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            what = "is not supported by this server" if m.role in ("tool", "function") else "is not a known role"
            raise APIError(400, f"messages[{i}].role '{m.role}' {what}; use system, user or assistant.",
                           param=f"messages[{i}].role", code="invalid_value")
        msgs.append(Message(role, _text(m, i)))
    if msgs[-1].role != "user":
        raise APIError(400, f"The last message must come from the user; it has role '{req.messages[-1].role}'.",
                       param="messages", code="invalid_value")
    system = []
    while msgs and msgs[0].role == "system":
        system.append(msgs.pop(0).content)
    return ("\n\n".join(system) if system else None), msgs[:-1], msgs[-1].content


def _unsupported(req: ChatRequest) -> None:
    if req.n not in (None, 1):
        raise APIError(400, f"This server makes one choice per request; 'n' must be 1 (got {req.n}).",
                       param="n", code="invalid_value")
    if req.logprobs:
        raise APIError(400, "This server does not return logprobs.", param="logprobs", code="invalid_value")
    if req.tools:
        raise APIError(400, "This server does not call tools.", param="tools", code="invalid_value")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(400, "This server answers in plain text only; 'response_format' must be 'text'.",
                       param="response_format", code="invalid_value")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > MAX_STOP:
        raise APIError(400, f"'stop' holds at most {MAX_STOP} sequences (got {len(items)}).",
                       param="stop", code="invalid_value")
    return tuple(s for s in items if s)


# ---- the response -----------------------------------------------------------------------
def _usage(stats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's name for prompt tokens served from a cache: our reused prefix.
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


def _extension(reason: str, stats) -> dict[str, Any]:
    """attnchat's figures for the reply (the ``attnchat`` field; OpenAI clients ignore it)."""
    d = stats.to_dict()
    d["finish_reason"] = reason
    return d


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = APIError(413, f"The request body passes this server's limit of {limit:,} bytes; "
                            "send a shorter conversation.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_BYTES:
        too_big.headers = {"Connection": "close"}
        raise too_big
    size, parts = 0, []
    stream = request.stream()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    async for chunk in stream:  # drain, so the client gets to read the 413
                        size += len(chunk)
                        if size > DRAIN_BYTES:
                            too_big.headers = {"Connection": "close"}
                            break
                    raise too_big
                parts.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {BODY_TIMEOUT_S:g} seconds; send it at once.",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(parts)


# ---- the app ----------------------------------------------------------------------------
def create_app(model: Model, *, api_key: str | None = None, model_id: str | None = None,
               settings: GenerationSettings | None = None, sessions: int = 4,
               default_temperature: float = 0.0, default_max_tokens: int = 1024, max_tokens_limit: int = 4096,
               max_body_bytes: int = MAX_BODY_BYTES, max_queued: int = MAX_QUEUED, allowed_hosts: Sequence[str] = (),
               cors_origins: Sequence[str] = ()) -> FastAPI:
    """The HTTP app serving ``model``.

    Args:
        model: the loaded model; one engine thread runs it.
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        model_id: the id clients name in ``model`` (default: the model's name).
        settings: the sessions' context, cache dtype and overflow policy.
        sessions: conversations that keep their KV cache between requests.
        default_temperature: for requests without ``temperature`` (0 = greedy, as ``attnchat chat``).
        default_max_tokens: for requests without ``max_tokens`` (tokens).
        max_tokens_limit: the most a request may ask for (tokens); more is a 400, so one
            request cannot hold the only worker for a whole context's worth of decoding.
        max_body_bytes: largest request body (bytes).
        max_queued: requests that may wait behind the running one; more get 429.
        allowed_hosts: ``Host`` names answered besides the loopback names (the bound
            address, ``--allowed-host``); see :mod:`attnchat.server_guard`.
        cors_origins: web origins whose pages may call the API (``--cors-origin``).

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
    engine = Engine(model, settings=settings, sessions=sessions, max_queued=max_queued)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="attnchat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.model_id = model_id

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "attnchat",
                "context_length": engine.context_limit}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        if name.lower() not in aliases:
            raise _no_model(name, model_id)
        return model_card()

    @v1.get("/attnchat/stats")
    async def stats() -> dict[str, Any]:
        return {"model": model_id, "device": str(model.device), "context_limit": engine.context_limit,
                **engine.stats()}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(await _read_body(request, max_body_bytes))
        if req.model.lower() not in aliases:
            raise _no_model(req.model, model_id)
        _unsupported(req)
        system, history, user = _conversation(req)
        try:
            temperature = default_temperature if req.temperature is None else req.temperature
            sampling = SamplingParams(
                temperature=temperature,
                top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),  # top_p 0: the top token only
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
        if max_tokens > max_tokens_limit:
            param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise APIError(400, f"'{param}' is too large: {max_tokens}. This server answers with at most "
                                f"{max_tokens_limit} tokens (--max-tokens-limit).", param=param, code="invalid_value")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Item | None] = asyncio.Queue()
        job = Job(system=system, history=history, user=user, sampling=sampling,
                  max_tokens=min(max_tokens, engine.context_limit), stop=_stops(req.stop),
                  emit=lambda item: loop.call_soon_threadsafe(items.put_nowait, item),
                  id=f"chatcmpl-{uuid.uuid4().hex}")
        try:
            engine.submit(job)
        except QueueFullError:
            raise APIError(429, f"The server is busy: {engine.max_queued} requests are waiting already. "
                                f"Try again in {RETRY_AFTER_S} seconds.", type="server_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        # Until the reply streams (Starlette then watches the connection itself), a task
        # watches for the client leaving: it cancels the job and wakes this handler.
        watcher = asyncio.create_task(_watch_disconnect(request, engine, job, items))
        try:
            item = await items.get()
            if item is None:
                return Response(status_code=499)  # the client left; nobody reads this
            if not isinstance(item, Started):
                return _failure(item)
            if req.stream:
                watcher.cancel()
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(_stream(items, engine, job, model_id, include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            while not isinstance(item, (Done, Failed)):
                item = await items.get()
                if item is None:
                    return Response(status_code=499)
        finally:
            watcher.cancel()
        if isinstance(item, Failed) or item.reason == "cancelled":
            return _failure(item)
        return JSONResponse({
            "id": job.id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": item.text},
                         "logprobs": None, "finish_reason": FINISH_REASONS[item.reason]}],
            "usage": _usage(item.stats),
            "attnchat": _extension(item.reason, item.stats),
        })

    app.include_router(v1)
    app.add_middleware(Guard, hosts=allowed_hosts, cors_origins=cors_origins)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError,
                              lambda request, e: _from_validation(list(e.errors())).response())
    app.add_exception_handler(Exception, _internal_error)
    return app


def _parse(body: bytes) -> ChatRequest:
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as e:
        raise _from_validation(e.errors()) from None


def _no_model(name: str, model_id: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this server serves '{model_id}' (GET /v1/models).",
                    param="model", code="model_not_found")


def _failure(item: Item) -> JSONResponse:
    if isinstance(item, Failed) and isinstance(item.error, ContextOverflowError):
        text = str(item.error)
        return APIError(400, text[:1].upper() + text[1:] + ".",
                        param="messages", code="context_length_exceeded").response()
    if isinstance(item, Failed):
        return APIError(500, f"The server failed to answer: {type(item.error).__name__}: {item.error}",
                        type="server_error").response()
    return APIError(503, "The server is shutting down; the request was not answered.",
                    type="server_error", code="unavailable").response()


async def _watch_disconnect(request: Request, engine: Engine, job: Job, items: asyncio.Queue) -> None:
    """Cancel ``job`` and put ``None`` in ``items`` once the client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    engine.cancel(job)
    items.put_nowait(None)


async def _stream(items: asyncio.Queue, engine: Engine, job: Job, model_id: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """The reply as OpenAI chunks; Starlette cancels this generator when the client leaves."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return _sse({"id": job.id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                     "system_fingerprint": None,
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        while not finished:
            batch = [await items.get()]
            while not items.empty():  # send what piled up as one chunk
                batch.append(items.get_nowait())
            if None in batch:  # the client left before the stream began
                return
            text = "".join(i.text for i in batch if isinstance(i, Delta))
            if text:
                yield chunk({"content": text})
            end = next((i for i in batch if isinstance(i, (Done, Failed))), None)
            if end is None:
                continue
            finished = True
            if isinstance(end, Failed) or end.reason == "cancelled":
                body = _failure(end).body
                yield f"data: {body.decode()}\n\n"
                return
            yield chunk({}, FINISH_REASONS[end.reason], attnchat=_extension(end.reason, end.stats))
            if include_usage:
                yield _sse({"id": job.id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                            "system_fingerprint": None, "choices": [], "usage": _usage(end.stats)})
            yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected (or the server is stopping)
            log.info("client left during %s; cancelling it", job.id)
            engine.cancel(job)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if e.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})."
    elif e.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(e.detail)
    return APIError(e.status_code, message, headers=getattr(e, "headers", None)).response()


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(500, f"The server failed to answer: {type(e).__name__}.", type="server_error").response()
