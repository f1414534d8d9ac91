"""Reading a request: its body (size and time limits), the chat request's fields, the
conversation they hold, and what the request asks of the engine (stop sequences, a
grammar, logits processors). Bad input raises :class:`attnchat.server.errors.APIError`.
Must not import Qt.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from attnchat.server import tools
from attnchat.server.errors import APIError, from_validation
from runtime import Message, Model
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
