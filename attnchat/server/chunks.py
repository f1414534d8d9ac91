"""Shaping a reply for the client: OpenAI's ``usage``, attnchat's own figures, logprobs,
the chat message (a tool call when the reply is one), and the server-sent event chunks
of a streamed chat or text completion. No engine, no HTTP here. Must not import Qt.
"""
from __future__ import annotations

import json
import time
from typing import Any

from attnchat.server import completions, tools
from attnchat.server.engine import Done, Job
from runtime.generate.logits_processors import LogprobsRecorder

#: The reason of a streamed reply the server cut because it is stopping (Ctrl-C on ``attnchat
#: serve``): OpenAI's ``length`` (cut short, not ended by the model), ``shutdown`` in the
#: ``attnchat`` block.
SHUTDOWN = "shutdown"
#: Session finish reasons -> OpenAI's ("context": the reply ran out of room).
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", SHUTDOWN: "length"}


def usage_of(stats) -> dict[str, Any]:
    """OpenAI's ``usage`` block of a reply's :class:`runtime.generate.events.TurnStats` (tokens)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's name for prompt tokens served from a cache: our reused prefix.
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


def extension_of(reason: str, stats) -> dict[str, Any]:
    """attnchat's figures for the reply (the ``attnchat`` field; OpenAI clients ignore it)."""
    d = stats.to_dict()
    d["finish_reason"] = reason
    if not (d.get("decode_threads") or d.get("max_threads")):
        # not measured (a batched reply, or off the CPU): left out rather than said as 0 threads
        d.pop("decode_threads", None)
        d.pop("max_threads", None)
    return d


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class LogprobsFormat:
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


def reply_message(done: Done, with_tools: bool) -> dict[str, Any]:
    """The choice's ``message`` and ``finish_reason``: a tool call when the reply is one.

    A call that did not finish (the token limit, the context or a stop sequence cut it) is
    never returned as text: as OpenAI does, ``tool_calls`` holds its name and the arguments
    written so far and ``finish_reason`` says why it stopped (``length``); cut before its
    name was whole, the content is empty."""
    if not (with_tools and tools.is_call(done.text)):
        return {"message": {"role": "assistant", "content": done.text},
                "finish_reason": FINISH_REASONS[done.reason]}
    calls = tools.parse_reply(done.text) if done.reason == "stop" else None
    if calls:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": "tool_calls"}
    cut = tools.parse_cut(done.text)
    message = {"role": "assistant", "content": None, "tool_calls": cut} if cut else {"role": "assistant", "content": ""}
    return {"message": message, "finish_reason": FINISH_REASONS[done.reason]}


class ChatChunks:
    """Chat completion chunks (``chat.completion.chunk``) for :func:`attnchat.server.relay.stream_reply`.

    With tools, a reply that starts with ``<`` is a call (see :mod:`attnchat.server.tools`): its
    text is held back and sent as one ``tool_calls`` delta when it ends (cut short: the
    arguments so far, see :func:`reply_message`).
    """

    def __init__(self, job: Job, model_id: str, logprobs: LogprobsFormat, with_tools: bool = False,
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
        shaped = reply_message(done, self.with_tools)
        out = ""
        if shaped["message"].get("tool_calls"):  # a call, whole or cut short
            deltas = [{"index": i, **c} for i, c in enumerate(shaped["message"]["tool_calls"])]
            out = self._chunk({"tool_calls": deltas}, lp=self.logprobs.ready())
        elif self.held and shaped["message"]["content"]:  # text held back while it could have been a call
            out = self._chunk({"content": self.held}, lp=self.logprobs.ready())
        return out + self._chunk({}, shaped["finish_reason"], lp=self.logprobs.rest(done.token_ids),
                                 attnchat=extension_of(done.reason, done.stats))

    def usage(self, done: Done) -> str:
        return _sse({"id": self.job.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model_id, "system_fingerprint": None, "choices": [], "usage": usage_of(done.stats)})


class CompletionChunks:
    """Text completion chunks (``text_completion``) for :func:`attnchat.server.relay.stream_reply`;
    ``echo`` first."""

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
        if not self.echo:
            return None
        lp = None
        if self.recorder is not None:
            # the prompt is scored before the reply starts (attnchat.server.engine.Job.prompt_entries)
            lp = completions.echo_block(self.tokenizer, self.echo, self.job.prompt_entries)
        return completions.chunk(self.job.id, self.model_id, self.created, self.echo, logprobs=lp)

    def text(self, text: str) -> str:
        lp = self._lp(list(self.recorder.tokens)) if self.recorder else None
        return completions.chunk(self.job.id, self.model_id, self.created, text, logprobs=lp)

    def end(self, done: Done) -> str:
        lp = self._lp(self.recorder.finish(done.token_ids)) if self.recorder else None
        return completions.chunk(self.job.id, self.model_id, self.created, "", FINISH_REASONS[done.reason], lp,
                                 attnchat=extension_of(done.reason, done.stats))

    def usage(self, done: Done) -> str:
        return completions.usage_chunk(self.job.id, self.model_id, self.created, usage_of(done.stats))
