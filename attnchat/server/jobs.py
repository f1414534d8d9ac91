"""What the server's engine takes and gives: a :class:`Job` in, plain-data items out.

No HTTP, no asyncio and no Qt here: the HTTP layer builds a :class:`Job` with a
thread-safe ``emit`` callback; an engine (:mod:`attnchat.server.engine`, one reply at a time, or
:mod:`attnchat.server.batching`, several at once) replies with :class:`Started`, :class:`Delta`,
:class:`Done` or :class:`Failed`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from runtime import Message, SamplingParams, TurnStats


class QueueFullError(Exception):
    """The queue holds :attr:`Engine.max_queued` jobs already; try again later."""


# ---- what the worker sends back ---------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """The prompt fits and prefill has begun (``prompt_tokens`` after the overflow policy)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """New reply text."""

    text: str


@dataclass(frozen=True)
class Done:
    """The reply ended; ``reason`` is the session's: stop, length, context or cancelled.
    ``token_ids``: the reply's sampled tokens (no end-of-turn token)."""

    reason: str
    text: str
    stats: TurnStats
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Failed:
    """The request could not run (``error`` is a :class:`ContextOverflowError` or a bug)."""

    error: Exception


Item = Started | Delta | Done | Failed


@dataclass
class Job:
    """One chat completion request.

    Attributes:
        system: system prompt (``None``: the chat template's default).
        messages: the conversation after the system prompt: it ends with the message to
            reply to, or with an assistant message to continue (a prefill), or is empty.
        emit: called from the worker thread with each :data:`Item`; must be thread-safe
            and must not block.
        sampling: how to pick tokens.
        max_tokens: most tokens in the reply (at least 1).
        stop: strings that end the reply (not shown).
        logits_processors: per-step hooks for this reply (structured output, penalties,
            logprobs; see :data:`runtime.LogitsProcessor`), made for this job alone.
        tools: function descriptions for the model's chat template to render (OpenAI's
            ``tools`` entries; empty when the template knows no tools or none are offered).
    """

    system: str | None
    messages: list[Message]
    emit: Callable[[Item], None]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    logits_processors: tuple = ()
    tools: tuple[dict, ...] = ()
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: Whose caches this job may reuse: the API key it came with (an opaque label, never
    #: the key itself); "" for every request of a server without keys.
    partition: str = ""
    #: The client's address as the HTTP connection gave it ("" when unknown): the request log's.
    client: str = ""
    #: Alternatives per prompt token when the prompt's own log-probabilities are asked for
    #: (``/v1/completions`` with ``echo`` and ``logprobs``); None: not asked.
    prompt_logprobs: int | None = None
    #: Filled by the worker before :class:`Started` when ``prompt_logprobs`` is set: the
    #: prompt's ids and an entry per id (:func:`runtime.generate.scoring.token_logprobs`).
    prompt_entries: tuple[list[int], list] | None = None

    def conversation(self) -> list[Message]:
        return [Message("system", self.system or "")] + self.messages
