"""The two generation routes, ``POST /v1/chat/completions`` and ``POST /v1/completions``:
each reads its request, checks it, builds a :class:`attnchat.server.engine.Job` and hands
it to :func:`attnchat.server.relay.answer`. :func:`attnchat.server.app.create_app`
registers them. Must not import Qt.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from attnchat.server import completions, tools
from attnchat.server.chunks import (
    FINISH_REASONS,
    ChatChunks,
    CompletionChunks,
    LogprobsFormat,
    extension_of,
    reply_message,
    usage_of,
)
from attnchat.server.engine import Done, Engine, Job
from attnchat.server.errors import APIError, from_validation, no_model
from attnchat.server.relay import answer, stream_reply
from attnchat.server.request import (
    conversation,
    logits_processors,
    parse_chat,
    read_body,
    response_grammar,
    stops,
    tools_grammar,
    unsupported,
)
from runtime import Message, Model, SamplingParams
from runtime.generate.events import TEXT_ROLE
from runtime.generate.logits_processors import LogprobsRecorder


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


async def chat_completions(serving: Serving, request: Request) -> Response:
    """``POST /v1/chat/completions``: a chat reply, whole or streamed; bad input is an :class:`APIError`."""
    model, model_id, engine = serving.model, serving.model_id, serving.engine
    req = parse_chat(await read_body(request, serving.max_body_bytes))
    if req.model.lower() not in serving.aliases:
        raise no_model(req.model, model_id)
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
    try:
        temperature = serving.default_temperature if req.temperature is None else req.temperature
        sampling = SamplingParams(
            temperature=temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),  # top_p 0: the top token only
            top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    max_tokens = req.max_completion_tokens or req.max_tokens or serving.default_max_tokens
    if max_tokens > serving.max_tokens_limit:
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise APIError(400, f"'{param}' is too large: {max_tokens}. This server answers with at most "
                            f"{serving.max_tokens_limit} tokens (--max-tokens-limit).", param=param,
                       code="invalid_value")
    reply_tokens = min(max_tokens, engine.context_limit)
    grammar = await (tools_grammar(model, offered, forced, reply_tokens) if offered
                     else response_grammar(model, req.response_format, reply_tokens))
    recorder = LogprobsRecorder(req.top_logprobs or 0) if req.logprobs else None
    processors = logits_processors(req.frequency_penalty, req.presence_penalty, grammar, recorder)
    job = Job(system=system, messages=messages, sampling=sampling, logits_processors=processors,
              max_tokens=reply_tokens, stop=stops(req.stop),
              tools=tuple(t.openai() for t in offered) if serving.template_tools else (),
              emit=None, id=f"chatcmpl-{uuid.uuid4().hex}", partition=getattr(request.state, "partition", ""))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await answer(
        engine, request, job, bool(req.stream),
        lambda items: stream_reply(items, engine, job,
                                   ChatChunks(job, model_id, LogprobsFormat(model.tokenizer, recorder),
                                              bool(offered), forced is not None),
                                   include_usage),
        lambda item: {
            "id": job.id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
            "system_fingerprint": None,
            "choices": [{"index": 0, **reply_message(item, bool(offered)),
                         "logprobs": LogprobsFormat(model.tokenizer, recorder).rest(item.token_ids)}],
            "usage": usage_of(item.stats),
            "attnchat": extension_of(item.reason, item.stats),
        })


async def text_completions(serving: Serving, request: Request) -> Response:
    """``POST /v1/completions``: the text after a raw prompt (see :mod:`attnchat.server.completions`)."""
    model, model_id, engine = serving.model, serving.model_id, serving.engine
    try:
        req = completions.CompletionRequest.model_validate_json(await read_body(request, serving.max_body_bytes))
    except ValidationError as e:
        raise from_validation(e.errors()) from None
    if req.model.lower() not in serving.aliases:
        raise no_model(req.model, model_id)
    try:
        prompt = completions.prompt_text(req)
    except ValueError as e:
        param, message = e.args
        raise APIError(400, message, param=param, code="invalid_value") from None
    try:
        sampling = SamplingParams(
            temperature=serving.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),
            top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    recorder = LogprobsRecorder(req.logprobs) if req.logprobs is not None else None
    processors = logits_processors(req.frequency_penalty, req.presence_penalty, None, recorder)
    max_tokens = req.max_tokens or completions.DEFAULT_MAX_TOKENS
    if max_tokens > serving.max_tokens_limit:
        raise APIError(400, f"'max_tokens' is too large: {max_tokens}. This server answers with at most "
                            f"{serving.max_tokens_limit} tokens (--max-tokens-limit).", param="max_tokens",
                       code="invalid_value")
    job = Job(system=None, messages=[Message(TEXT_ROLE, prompt)], sampling=sampling,
              logits_processors=processors, max_tokens=min(max_tokens, engine.context_limit),
              stop=stops(req.stop), emit=None, id=f"cmpl-{uuid.uuid4().hex}",
              partition=getattr(request.state, "partition", ""),
              # echo with logprobs: the prompt's tokens get theirs too, as OpenAI's do
              prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    echo = prompt if req.echo else ""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def whole(item: Done) -> dict[str, Any]:
        lp = completions.logprobs_block(model.tokenizer, recorder.finish(item.token_ids), len(echo)) \
            if recorder is not None else None
        if lp is not None and echo:
            lp = completions.joined(completions.echo_block(model.tokenizer, prompt, job.prompt_entries), lp)
        return completions.response(job.id, model_id, echo + item.text, FINISH_REASONS[item.reason],
                                    usage_of(item.stats), lp, extension_of(item.reason, item.stats))

    return await answer(
        engine, request, job, bool(req.stream),
        lambda items: stream_reply(items, engine, job,
                                   CompletionChunks(job, model_id, model.tokenizer, recorder, echo),
                                   include_usage),
        whole)
