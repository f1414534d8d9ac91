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
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnchat import completions, tools
from attnchat.metrics import CONTENT_TYPE as METRICS_TYPE
from attnchat.metrics import CountRequests, Metrics
from attnchat.serve_engine import (
    MAX_QUEUED,
    POOL_BYTES,
    Delta,
    Done,
    Engine,
    Failed,
    Item,
    Job,
    QueueFullError,
    Started,
)
from attnchat.server_guard import Guard, normalize_origin
from models.catalog import CATALOG
from runtime import ContextOverflowError, GenerationSettings, Message, Model, SamplingParams
from runtime.logits_processors import LogprobsRecorder, PenaltyProcessor
from runtime.session import TEXT_ROLE

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
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


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
    stream: bool | None = None
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
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


def _text(msg: _Message, i: int) -> str:
    if msg.content is None:
        if msg.role == "assistant" or msg.tool_calls:
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


def _conversation(req: ChatRequest, tool_role: bool = False) -> tuple[str | None, list[Message]]:
    """(system prompt, the messages after it), or :class:`APIError` for a bad conversation.

    As OpenAI, a list of system messages only is answered; as llama-server and Ollama,
    a last message from the assistant is continued (the reply starts from its text).
    ``tool_role``: tool results stay ``tool`` messages (for a chat template that knows
    them), else they become user messages (:func:`attnchat.tools.render_result`).
    """
    if not req.messages:
        raise APIError(400, "'messages' must hold at least one message.", param="messages", code="invalid_value")
    msgs = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from earlier calls
    for i, m in enumerate(req.messages):
        if m.role == "tool" and tool_role:
            msgs.append(Message("tool", _text(m, i)))
            continue
        if m.role == "tool":  # a tool's result: read by the model as a user message
            msgs.append(Message("user", tools.render_result(call_names.get(m.tool_call_id or "", m.name),
                                                            _text(m, i))))
            continue
        role = ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}].role '{m.role}' is not a known role; use system, user, "
                                "assistant or tool.", param=f"messages[{i}].role", code="invalid_value")
        text = _text(m, i)
        for call in m.tool_calls or []:
            fn = call.get("function") or {}
            call_names[str(call.get("id"))] = fn.get("name")
            text += tools.render_call(str(fn.get("name")), fn.get("arguments") or {})
        msgs.append(Message(role, text))
    if msgs[-1].role == "assistant" and not msgs[-1].content:
        msgs.pop()  # an empty prefill: nothing to continue, a plain reply
    system = []
    while msgs and msgs[0].role == "system":
        system.append(msgs.pop(0).content)
    return ("\n\n".join(system) if system else None), msgs


def _unsupported(req: ChatRequest) -> None:
    if req.n not in (None, 1):
        raise APIError(400, f"This server makes one choice per request; 'n' must be 1 (got {req.n}).",
                       param="n", code="invalid_value")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"Invalid value for 'response_format.type': {kind!r}; use 'text', 'json_object' "
                            "or 'json_schema'.", param="response_format", code="invalid_value")


async def _tools_grammar(model: Model, offered: list, forced: str | None):
    """The grammar of a reply that may (or must) call one of ``offered``."""
    from runtime.constrained import GrammarError, compiler_for

    try:
        compiler = await asyncio.to_thread(compiler_for, model)
        return await asyncio.to_thread(compiler.lark, tools.grammar_source(offered, forced))
    except GrammarError as e:
        raise APIError(400, f"Invalid 'tools': a function's parameters cannot be used ({e}).", param="tools",
                       code="invalid_value") from None


async def _response_grammar(model: Model, response_format: dict[str, Any] | None):
    """The :class:`runtime.constrained.Grammar` a ``response_format`` asks for, or ``None``.

    Compiled off the event loop: the first one builds the tokenizer's index (seconds)."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    from runtime.constrained import GrammarError, compiler_for, schema_of

    try:
        schema = schema_of(response_format)
        compiler = await asyncio.to_thread(compiler_for, model)
        return await asyncio.to_thread(compiler.json_schema, schema)
    except GrammarError as e:
        raise APIError(400, f"Invalid 'response_format': {e}.", param="response_format",
                       code="invalid_value") from None


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
               cors_origins: Sequence[str] = (), pool_bytes: int = POOL_BYTES) -> FastAPI:
    """The HTTP app serving ``model``.

    Args:
        model: the loaded model; one engine thread runs it.
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        model_id: the id clients name in ``model`` (default: the model's name).
        settings: the sessions' context, cache dtype and overflow policy (default: the
            model's context, overflow ``stop``).
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
        pool_bytes: KV-cache bytes idle pooled sessions may keep (``--pool-mib``).

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
    engine = Engine(model, settings=settings or GenerationSettings(overflow="stop"), sessions=sessions,
                    max_queued=max_queued, pool_bytes=pool_bytes, on_reply=metrics.reply)
    created = int(time.time())
    # Tools through the model's own template where it renders them, else the fallback
    # prompt (see attnchat.tools); decided once, by rendering, before the engine runs.
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
            raise _no_model(name, model_id)
        return model_card()

    @v1.get("/attnchat/stats")
    async def stats() -> dict[str, Any]:
        return {"model": model_id, "device": str(model.device), "context_limit": engine.context_limit,
                "tool_prompt": "template" if template_tools else "fallback", **engine.stats()}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(await _read_body(request, max_body_bytes))
        if req.model.lower() not in aliases:
            raise _no_model(req.model, model_id)
        _unsupported(req)
        try:
            offered, forced = tools.parse_tools(req.tools, req.tool_choice)
        except tools.ToolError as e:
            raise APIError(400, e.args[1], param=e.args[0], code="invalid_value") from None
        system, messages = _conversation(req, tool_role=template_tools)
        if offered and (req.response_format or {}).get("type", "text") != "text":
            raise APIError(400, "Send either 'tools' or a JSON 'response_format', not both.",
                           param="response_format", code="invalid_value")
        if offered and not template_tools:
            system = "\n\n".join(x for x in (system, tools.system_prompt(offered)) if x)
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
        grammar = await (_tools_grammar(model, offered, forced) if offered
                         else _response_grammar(model, req.response_format))
        recorder = LogprobsRecorder(req.top_logprobs or 0) if req.logprobs else None
        processors = _processors(req.frequency_penalty, req.presence_penalty, grammar, recorder)
        job = Job(system=system, messages=messages, sampling=sampling, logits_processors=processors,
                  max_tokens=min(max_tokens, engine.context_limit), stop=_stops(req.stop),
                  tools=tuple(t.openai() for t in offered) if template_tools else (),
                  emit=None, id=f"chatcmpl-{uuid.uuid4().hex}")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await answer(
            request, job, bool(req.stream),
            lambda items: _stream(items, engine, job, _ChatChunks(job, model_id,
                                                                  _LogprobsFormat(model.tokenizer, recorder),
                                                                  bool(offered), forced is not None),
                                  include_usage),
            lambda item: {
                "id": job.id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "system_fingerprint": None,
                "choices": [{"index": 0, **_message(item, bool(offered)),
                             "logprobs": _LogprobsFormat(model.tokenizer, recorder).rest(item.token_ids)}],
                "usage": _usage(item.stats),
                "attnchat": _extension(item.reason, item.stats),
            })

    @v1.post("/completions")
    async def text_completions(request: Request) -> Response:
        try:
            req = completions.CompletionRequest.model_validate_json(await _read_body(request, max_body_bytes))
        except ValidationError as e:
            raise _from_validation(e.errors()) from None
        if req.model.lower() not in aliases:
            raise _no_model(req.model, model_id)
        try:
            prompt = completions.prompt_text(req)
        except ValueError as e:
            param, message = e.args
            raise APIError(400, message, param=param, code="invalid_value") from None
        try:
            sampling = SamplingParams(
                temperature=default_temperature if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        recorder = LogprobsRecorder(req.logprobs) if req.logprobs is not None else None
        processors = _processors(req.frequency_penalty, req.presence_penalty, None, recorder)
        max_tokens = req.max_tokens or completions.DEFAULT_MAX_TOKENS
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"'max_tokens' is too large: {max_tokens}. This server answers with at most "
                                f"{max_tokens_limit} tokens (--max-tokens-limit).", param="max_tokens",
                           code="invalid_value")
        job = Job(system=None, messages=[Message(TEXT_ROLE, prompt)], sampling=sampling,
                  logits_processors=processors, max_tokens=min(max_tokens, engine.context_limit),
                  stop=_stops(req.stop), emit=None, id=f"cmpl-{uuid.uuid4().hex}")
        echo = prompt if req.echo else ""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def whole(item: Done) -> dict[str, Any]:
            lp = completions.logprobs_block(model.tokenizer, recorder.finish(item.token_ids), len(echo)) \
                if recorder is not None else None
            return completions.response(job.id, model_id, echo + item.text, FINISH_REASONS[item.reason],
                                        _usage(item.stats), lp, _extension(item.reason, item.stats))

        return await answer(
            request, job, bool(req.stream),
            lambda items: _stream(items, engine, job, _CompletionChunks(job, model_id, model.tokenizer, recorder,
                                                                        echo), include_usage),
            whole)

    async def answer(request: Request, job: Job, stream: bool,
                     streamer: Callable[[asyncio.Queue], AsyncIterator[str]],
                     whole: Callable[[Done], dict[str, Any]]) -> Response:
        """Run ``job`` on the engine; its reply as server-sent events from ``streamer`` or
        as the JSON object ``whole`` makes of the :class:`Done` item."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Item | None] = asyncio.Queue()
        job.emit = lambda item: loop.call_soon_threadsafe(items.put_nowait, item)
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
            if stream:
                watcher.cancel()
                return StreamingResponse(streamer(items), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            while not isinstance(item, (Done, Failed)):
                item = await items.get()
                if item is None:
                    return Response(status_code=499)
        finally:
            watcher.cancel()
        if isinstance(item, Failed) or item.reason == "cancelled":
            return _failure(item)
        return JSONResponse(whole(item))

    app.include_router(v1)
    app.add_middleware(CountRequests, requests=metrics.requests)
    app.add_middleware(Guard, hosts=allowed_hosts, cors_origins=cors_origins)  # the outermost
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


def overflow_error(e: ContextOverflowError, what: str = "messages") -> APIError:
    """400 ``context_length_exceeded`` worded as OpenAI words it (litellm matches "maximum
    context length"), then the code and our own advice (langchain-openai matches the code
    in the text, which the openai client reduces to the message)."""
    text = str(e)
    return APIError(400, f"This model's maximum context length is {e.context_limit} tokens. However, your "
                         f"{what} resulted in {e.prompt_tokens} tokens. Please reduce the length of the {what}. "
                         f"(context_length_exceeded: {text}.)", param=what, code="context_length_exceeded")


def _no_model(name: str, model_id: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this server serves '{model_id}' (GET /v1/models).",
                    param="model", code="model_not_found")


def _failure(item: Item) -> JSONResponse:
    if isinstance(item, Failed) and isinstance(item.error, ContextOverflowError):
        return overflow_error(item.error).response()
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


def _processors(frequency_penalty: float | None, presence_penalty: float | None, grammar,
                recorder: LogprobsRecorder | None) -> tuple:
    """A reply's logits processors, in order: penalties, the grammar's mask, the logprobs
    recorder (which so sees the distribution really sampled from). None when unused."""
    out = []
    if frequency_penalty or presence_penalty:
        out.append(PenaltyProcessor(frequency_penalty or 0.0, presence_penalty or 0.0))
    if grammar is not None:
        out.append(grammar.processor())
    if recorder is not None:
        out.append(recorder)
    return tuple(out)


class _LogprobsFormat:
    """A :class:`LogprobsRecorder`'s entries in OpenAI's chat shape, handed out once each."""

    def __init__(self, tokenizer: Any, recorder: LogprobsRecorder | None):
        self.tokenizer, self.recorder, self.sent = tokenizer, recorder, 0

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    def _take(self, tokens: list) -> dict[str, Any] | None:
        if self.recorder is None:
            return None
        new, self.sent = tokens[self.sent:], len(tokens)
        return {"content": [{**self._entry(t.token_id, t.logprob),
                             "top_logprobs": [self._entry(i, lp) for i, lp in t.top]} for t in new],
                "refusal": None}

    def ready(self) -> dict[str, Any] | None:
        """Entries of tokens whose step has closed since the last call (``None``: not asked)."""
        return self._take(list(self.recorder.tokens)) if self.recorder is not None else None

    def rest(self, token_ids: tuple[int, ...]) -> dict[str, Any] | None:
        """The remaining entries, the reply's last token included."""
        return self._take(self.recorder.finish(token_ids)) if self.recorder is not None else None


def _message(done: Done, with_tools: bool) -> dict[str, Any]:
    """The choice's ``message`` and ``finish_reason``: a tool call when the reply is one."""
    calls = tools.parse_reply(done.text) if with_tools and done.reason == "stop" else None
    if calls:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": done.text}, "finish_reason": FINISH_REASONS[done.reason]}


class _ChatChunks:
    """Chat completion chunks (``chat.completion.chunk``) for :func:`_stream`.

    With tools, a reply that starts with ``<`` is a call (see :mod:`attnchat.tools`): its
    text is held back and sent as one ``tool_calls`` delta when it is complete.
    """

    def __init__(self, job: Job, model_id: str, logprobs: _LogprobsFormat, with_tools: bool = False,
                 forced: bool = False):
        self.job, self.model_id, self.logprobs, self.created = job, model_id, logprobs, int(time.time())
        self.with_tools = with_tools
        self.calling: bool | None = True if forced else (None if with_tools else False)
        self.held = ""

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, lp: dict | None = None, **extra: Any) -> str:
        return _sse({"id": self.job.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model_id, "system_fingerprint": None,
                     "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra})

    def first(self) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> str:
        if self.calling is None:
            stripped = (self.held + text).lstrip()
            if not stripped:
                self.held += text
                return ""
            self.calling = stripped.startswith("<")
        if self.calling:
            self.held += text
            return ""
        text, self.held = self.held + text, ""
        return self._chunk({"content": text}, lp=self.logprobs.ready())

    def end(self, done: Done) -> str:
        shaped = _message(done, self.with_tools)
        out = ""
        if shaped["finish_reason"] == "tool_calls":
            deltas = [{"index": i, **c} for i, c in enumerate(shaped["message"]["tool_calls"])]
            out = self._chunk({"tool_calls": deltas}, lp=self.logprobs.ready())
        elif self.held:  # text held back while it could have been a call
            out = self._chunk({"content": self.held}, lp=self.logprobs.ready())
        return out + self._chunk({}, shaped["finish_reason"], lp=self.logprobs.rest(done.token_ids),
                                 attnchat=_extension(done.reason, done.stats))

    def usage(self, done: Done) -> str:
        return _sse({"id": self.job.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model_id, "system_fingerprint": None, "choices": [], "usage": _usage(done.stats)})


async def _stream(items: asyncio.Queue, engine: Engine, job: Job, chunks: Any,
                  include_usage: bool) -> AsyncIterator[str]:
    """The reply as chunks (``chunks`` shapes them: :class:`_ChatChunks`, a completion's);
    Starlette cancels this generator when the client leaves."""
    finished = False
    try:
        first = chunks.first()
        if first:
            yield first
        while not finished:
            batch = [await items.get()]
            while not items.empty():  # send what piled up as one chunk
                batch.append(items.get_nowait())
            if None in batch:  # the client left before the stream began
                return
            text = "".join(i.text for i in batch if isinstance(i, Delta))
            if text:
                out = chunks.text(text)
                if out:
                    yield out
            end = next((i for i in batch if isinstance(i, (Done, Failed))), None)
            if end is None:
                continue
            finished = True
            if isinstance(end, Failed) or end.reason == "cancelled":
                body = _failure(end).body
                yield f"data: {body.decode()}\n\n"
                return
            yield chunks.end(end)
            if include_usage:
                yield chunks.usage(end)
            yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected (or the server is stopping)
            log.info("client left during %s; cancelling it", job.id)
            engine.cancel(job)


class _CompletionChunks:
    """Text completion chunks (``text_completion``) for :func:`_stream`; ``echo`` first."""

    def __init__(self, job: Job, model_id: str, tokenizer: Any, recorder: LogprobsRecorder | None, echo: str):
        self.job, self.model_id, self.tokenizer, self.recorder = job, model_id, tokenizer, recorder
        self.echo, self.created, self.sent, self.offset = echo, int(time.time()), 0, len(echo)

    def _lp(self, entries: list) -> dict | None:
        if self.recorder is None:
            return None
        new, self.sent = entries[self.sent:], len(entries)
        block = completions.logprobs_block(self.tokenizer, new, self.offset)
        self.offset += sum(len(t) for t in block["tokens"])
        return block

    def first(self) -> str | None:
        return completions.chunk(self.job.id, self.model_id, self.created, self.echo) if self.echo else None

    def text(self, text: str) -> str:
        lp = self._lp(list(self.recorder.tokens)) if self.recorder else None
        return completions.chunk(self.job.id, self.model_id, self.created, text, logprobs=lp)

    def end(self, done: Done) -> str:
        lp = self._lp(self.recorder.finish(done.token_ids)) if self.recorder else None
        return completions.chunk(self.job.id, self.model_id, self.created, "", FINISH_REASONS[done.reason], lp,
                                 attnchat=_extension(done.reason, done.stats))

    def usage(self, done: Done) -> str:
        return completions.usage_chunk(self.job.id, self.model_id, self.created, _usage(done.stats))


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
