"""Reading a request: its body (size and time limits), the chat request's fields, the
conversation they hold, and what the request asks of the engine (stop sequences, a
grammar, logits processors, sampling), made into the engine's job in one place:
:func:`chat_job` and :func:`text_job`. Bad input raises :class:`attnchat.server.errors.APIError`.
Must not import Qt.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from attnchat.server import completions, tools
from attnchat.server.engine import Engine, Job
from attnchat.server.errors import APIError, from_validation, no_model
from runtime import Message, Model, SamplingParams
from runtime.generate.events import TEXT_ROLE
from runtime.generate.logits_processors import LogprobsRecorder, PenaltyProcessor

#: Largest request body (bytes); a longer one gets 413. 1 MiB holds far more text than
#: the default model's 8192-token context.
MAX_BODY_BYTES = 1 << 20
#: A body over the limit is still read (and dropped) up to this size, so the client can
#: read the 413 instead of seeing its upload cut off.
DRAIN_BYTES = 16 << 20
#: A request body must arrive within this many seconds (408 after): a client that sends
#: a few bytes a minute must not hold a connection and a task for ever.
BODY_TIMEOUT_S = 30.0
#: OpenAI accepts at most 4 stop sequences.
MAX_STOP = 4
#: OpenAI's message roles -> the session's ("tool" is handled on its own).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


def conversation(req: ChatRequest, tool_role: bool = False) -> tuple[str | None, list[Message]]:
    """(system prompt, the messages after it), or :class:`APIError` for a bad conversation.

    As OpenAI, a list of system messages only is answered; as llama-server and Ollama,
    a last message from the assistant is continued (the reply starts from its text).
    ``tool_role``: tool results stay ``tool`` messages (for a chat template that knows
    them), else they become user messages (:func:`attnchat.server.tools.render_result`).
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


def unsupported(req: ChatRequest) -> None:
    """Raise :class:`APIError` for a request this server cannot honour (``n`` > 1, ...)."""
    if req.n not in (None, 1):
        raise APIError(400, f"This server makes one choice per request; 'n' must be 1 (got {req.n}).",
                       param="n", code="invalid_value")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"Invalid value for 'response_format.type': {kind!r}; use 'text', 'json_object' "
                            "or 'json_schema'.", param="response_format", code="invalid_value")


async def tools_grammar(model: Model, offered: list, forced: str | None, max_tokens: int | None = None):
    """The grammar of a reply that may (or must) call one of ``offered`` (a call's arguments
    capped to end within ``max_tokens``: :func:`attnchat.server.tools.grammar_source`)."""
    from runtime.generate.constrained import GrammarError, compiler_for

    budget = None if max_tokens is None else max(max_tokens - 1, 1)
    try:
        compiler = await asyncio.to_thread(compiler_for, model)
        return await asyncio.to_thread(compiler.lark, tools.grammar_source(offered, forced, budget))
    except GrammarError as e:
        raise APIError(400, f"Invalid 'tools': a function's parameters cannot be used ({e}).", param="tools",
                       code="invalid_value") from None


async def response_grammar(model: Model, response_format: dict[str, Any] | None, max_tokens: int | None = None):
    """The :class:`runtime.generate.constrained.Grammar` a ``response_format`` asks for, or ``None``;
    with ``max_tokens`` its caps are chosen so the longest value ends within them (the end of
    turn included: :func:`runtime.generate.json_bounds.fit`).

    Compiled off the event loop: the first one builds the tokenizer's index (seconds)."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    from runtime.generate.constrained import GrammarError, compiler_for, schema_of

    budget = None if max_tokens is None else max(max_tokens - 1, 1)  # the end-of-turn token is one more
    try:
        schema = schema_of(response_format)
        compiler = await asyncio.to_thread(compiler_for, model)
        return await asyncio.to_thread(compiler.json_schema, schema, budget=budget)
    except GrammarError as e:
        raise APIError(400, f"Invalid 'response_format': {e}.", param="response_format",
                       code="invalid_value") from None


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop sequences, empty ones dropped; at most :data:`MAX_STOP`."""
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > MAX_STOP:
        raise APIError(400, f"'stop' holds at most {MAX_STOP} sequences (got {len(items)}).",
                       param="stop", code="invalid_value")
    return tuple(s for s in items if s)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413 past it) within :data:`BODY_TIMEOUT_S` (408 after)."""
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


def parse_chat(body: bytes) -> ChatRequest:
    """A chat completion request from its JSON body, or a 400 :class:`APIError`."""
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(e.errors()) from None


def logits_processors(frequency_penalty: float | None, presence_penalty: float | None, grammar,
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


# ---- a request made a job ---------------------------------------------------------------
@dataclass(frozen=True)
class Serving:
    """What the routes share: the model, its engine, and the server's defaults and limits
    (see :func:`attnchat.server.app.create_app` for each)."""

    model: Model
    model_id: str
    engine: Engine
    aliases: frozenset[str]  # names a request may use for the model, lower case
    template_tools: bool  # tools go through the model's chat template (else the fallback prompt)
    default_temperature: float
    default_max_tokens: int  # tokens
    max_tokens_limit: int  # tokens
    max_body_bytes: int


@dataclass(frozen=True)
class ChatJob:
    """A chat request as the engine's :class:`Job`, with what its reply is shaped by: the
    logprobs recorder (None: not asked for), the tools offered and the one forced (or None)."""

    job: Job
    recorder: LogprobsRecorder | None
    offered: list
    forced: str | None


def _sampling(req, default_temperature: float) -> SamplingParams:
    """The sampling a chat or text request asks for (its ``temperature`` or the server's default)."""
    try:
        return SamplingParams(
            temperature=default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),  # top_p 0: the top token only
            top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def _within_limit(max_tokens: int, param: str, limit: int) -> int:
    """``max_tokens`` when at most ``limit`` (``--max-tokens-limit``); else a 400 naming ``param``."""
    if max_tokens > limit:
        raise APIError(400, f"'{param}' is too large: {max_tokens}. This server answers with at most "
                            f"{limit} tokens (--max-tokens-limit).", param=param, code="invalid_value")
    return max_tokens


async def chat_job(serving: Serving, req: ChatRequest, partition: str) -> ChatJob:
    """The job a chat request asks for: the model named, the fields checked, the conversation,
    tools or a JSON format (compiled into a grammar), sampling, the reply's length.

    Raises:
        APIError: bad input (another model, an unsupported field, invalid tools or format, past a limit).
    """
    if req.model.lower() not in serving.aliases:
        raise no_model(req.model, serving.model_id)
    unsupported(req)
    try:
        offered, forced = tools.parse_tools(req.tools, req.tool_choice)
    except tools.ToolError as e:
        raise APIError(400, e.args[1], param=e.args[0], code="invalid_value") from None
    system, messages = conversation(req, tool_role=serving.template_tools)
    if offered and (req.response_format or {}).get("type", "text") != "text":
        raise APIError(400, "Send either 'tools' or a JSON 'response_format', not both.",
                       param="response_format", code="invalid_value")
    if offered and not serving.template_tools:
        system = "\n\n".join(x for x in (system, tools.system_prompt(offered)) if x)
    sampling = _sampling(req, serving.default_temperature)
    max_tokens = req.max_completion_tokens or req.max_tokens or serving.default_max_tokens
    _within_limit(max_tokens, "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                  serving.max_tokens_limit)
    reply_tokens = min(max_tokens, serving.engine.context_limit)
    grammar = await (tools_grammar(serving.model, offered, forced, reply_tokens) if offered
                     else response_grammar(serving.model, req.response_format, reply_tokens))
    recorder = LogprobsRecorder(req.top_logprobs or 0) if req.logprobs else None
    job = Job(system=system, messages=messages, sampling=sampling,
              logits_processors=logits_processors(req.frequency_penalty, req.presence_penalty, grammar, recorder),
              max_tokens=reply_tokens, stop=stops(req.stop),
              tools=tuple(t.openai() for t in offered) if serving.template_tools else (),
              emit=None, id=f"chatcmpl-{uuid.uuid4().hex}", partition=partition)
    return ChatJob(job, recorder, offered, forced)


def text_job(serving: Serving, req: completions.CompletionRequest, partition: str
             ) -> tuple[Job, LogprobsRecorder | None, str]:
    """``(job, logprobs recorder or None, prompt)`` of a text completion request (a raw prompt,
    no chat template: :mod:`attnchat.server.completions`).

    Raises:
        APIError: bad input (another model, a bad prompt, past a limit).
    """
    if req.model.lower() not in serving.aliases:
        raise no_model(req.model, serving.model_id)
    try:
        prompt = completions.prompt_text(req)
    except ValueError as e:
        param, message = e.args
        raise APIError(400, message, param=param, code="invalid_value") from None
    sampling = _sampling(req, serving.default_temperature)
    recorder = LogprobsRecorder(req.logprobs) if req.logprobs is not None else None
    processors = logits_processors(req.frequency_penalty, req.presence_penalty, None, recorder)
    max_tokens = _within_limit(req.max_tokens or completions.DEFAULT_MAX_TOKENS, "max_tokens",
                               serving.max_tokens_limit)
    job = Job(system=None, messages=[Message(TEXT_ROLE, prompt)], sampling=sampling,
              logits_processors=processors, max_tokens=min(max_tokens, serving.engine.context_limit),
              stop=stops(req.stop), emit=None, id=f"cmpl-{uuid.uuid4().hex}", partition=partition,
              # echo with logprobs: the prompt's tokens get theirs too, as OpenAI's do
              prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    return job, recorder, prompt
