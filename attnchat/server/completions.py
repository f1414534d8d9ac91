"""OpenAI's legacy text completions, ``POST /v1/completions``: a prompt in, its continuation out.

For models without a chat template and for editor plug-ins. The prompt is tokenized as
it is (the tokenizer's own special tokens added, no chat template, special-token
strings in it read as special tokens: the client writes the whole prompt) and continued
by the same engine and sessions as chat. This module shapes requests and responses
only; :mod:`attnchat.server` registers the route. Must not import Qt.
"""
from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16
#: OpenAI's largest ``logprobs`` for completions.
MAX_LOGPROBS = 5


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completion request (others are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    prompt: str | list[str]
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)


def prompt_text(req: CompletionRequest) -> str:
    """The one prompt of ``req``.

    Raises:
        ValueError: (param, message) for what this server cannot do: several prompts,
            ``n``/``best_of`` > 1, a ``suffix`` (no fill-in-the-middle), an empty prompt.
    """
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) != 1:
        raise ValueError("prompt", f"This server completes one prompt per request; 'prompt' holds {len(prompts)}.")
    if req.n not in (None, 1):
        raise ValueError("n", f"This server makes one choice per request; 'n' must be 1 (got {req.n}).")
    if req.best_of not in (None, 1):
        raise ValueError("best_of", f"'best_of' must be 1 on this server (got {req.best_of}).")
    if req.suffix:
        raise ValueError("suffix", "This model has no fill-in-the-middle mode, so 'suffix' cannot be honoured; "
                                   "send the text before the gap as 'prompt' and leave 'suffix' out.")
    if not prompts[0]:
        raise ValueError("prompt", "'prompt' is empty; send the text to continue.")
    return prompts[0]


def logprobs_block(tokenizer: Any, entries: list, offset: int) -> dict[str, Any]:
    """OpenAI's completion ``logprobs``: tokens, their logprobs, the top alternatives as
    ``{token: logprob}`` and each token's character offset (from ``offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = tokenizer.decode([e.token_id])
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        lps.append(max(e.logprob, -9999.0))
        tops.append({tokenizer.decode([i]): max(lp, -9999.0) for i, lp in e.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_block(tokenizer: Any, prompt: str, scored: tuple[list[int], list] | None) -> dict[str, Any]:
    """The prompt's part of ``logprobs`` with ``echo`` (OpenAI's: each prompt token with its
    log-probability given the ones before it; the first has none): ``scored`` is
    :attr:`attnchat.server.engine.Job.prompt_entries`. Tokens the tokenizer adds itself (a
    BOS) condition the first token but are not listed: the echoed text does not hold them."""
    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if scored is None:
        return empty
    ids, entries = scored
    plain = list(tokenizer.encode(prompt, add_special_tokens=False))
    added = len(ids) - len(plain) if len(plain) <= len(ids) and ids[len(ids) - len(plain):] == plain else 0
    out, offset = {k: [] for k in empty}, 0
    for token, entry in zip(ids[added:], entries[added:]):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(max(entry.logprob, -9999.0))
            out["top_logprobs"].append({tokenizer.decode([i]): max(lp, -9999.0) for i, lp in entry.top})
    return out


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two ``logprobs`` blocks one after the other (the echoed prompt's, then the reply's)."""
    return first if then is None else {k: first[k] + then[k] for k in first}


def response(job_id: str, model_id: str, text: str, finish_reason: str, usage: dict[str, Any],
             logprobs: dict[str, Any] | None, extension: dict[str, Any]) -> dict[str, Any]:
    return {"id": job_id, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage, "attnchat": extension}


def chunk(job_id: str, model_id: str, created: int, text: str, finish_reason: str | None = None,
          logprobs: dict[str, Any] | None = None, **extra: Any) -> str:
    body = {"id": job_id, "object": "text_completion", "created": created, "model": model_id,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}], **extra}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def usage_chunk(job_id: str, model_id: str, created: int, usage: dict[str, Any]) -> str:
    body = {"id": job_id, "object": "text_completion", "created": created, "model": model_id,
            "system_fingerprint": None, "choices": [], "usage": usage}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
