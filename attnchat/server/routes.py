"""The two generation routes, ``POST /v1/chat/completions`` and ``POST /v1/completions``:
each reads its request, has :mod:`attnchat.server.request` make it a job
(:func:`~attnchat.server.request.chat_job`, :func:`~attnchat.server.request.text_job`) and
hands it to :func:`attnchat.server.relay.answer`, shaping the reply. :func:`attnchat.server.app.create_app`
registers them. Must not import Qt.
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from attnchat.server import completions
from attnchat.server.chunks import (
    FINISH_REASONS,
    ChatChunks,
    CompletionChunks,
    LogprobsFormat,
    extension_of,
    reply_message,
    usage_of,
)
from attnchat.server.engine import Done
from attnchat.server.errors import from_validation
from attnchat.server.relay import answer, stream_reply
from attnchat.server.request import Serving, chat_job, parse_chat, read_body, text_job

__all__ = ["Serving", "chat_completions", "text_completions"]


async def chat_completions(serving: Serving, request: Request) -> Response:
    """``POST /v1/chat/completions``: a chat reply, whole or streamed; bad input is an :class:`APIError`."""
    model, model_id, engine = serving.model, serving.model_id, serving.engine
    req = parse_chat(await read_body(request, serving.max_body_bytes))
    made = await chat_job(serving, req, getattr(request.state, "partition", ""))
    job, recorder, offered, forced = made.job, made.recorder, made.offered, made.forced
    job.client = request.client.host if request.client else ""
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
    job, recorder, prompt = text_job(serving, req, getattr(request.state, "partition", ""))
    job.client = request.client.host if request.client else ""
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
