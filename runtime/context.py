"""Context-overflow policies: what a chat session does when the conversation outgrows the context.

Must not import Qt (nor torch: these are pure functions over token ids and messages;
:mod:`runtime.session` applies them to its KV cache).

- ``stop``: the reply ends with finish reason ``"context"``.
- ``truncate-middle``: keep the system prompt and the newest turns, drop the oldest
  turns in between (before the reply, and again while it runs), re-prefill what
  changed; the session reports the tokens dropped from the conversation.
- ``rolling``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models
  with Attention Sinks", arXiv:2309.17453): keep the first ``sink_tokens`` tokens and a
  window of the newest; evict the middle from the cache. Positions: keys are cached
  after RoPE, and after an eviction the kept keys are re-rotated by minus the evicted
  count (RoPE rotations compose), so cache slot ``i`` always holds position ``i`` and
  the model never sees a position past the window. We chose re-rotation over caching
  keys before RoPE because it costs one rotation per eviction instead of one per
  cached key on every decode step.

A message that cannot fit even alone (with the system prompt and the template) raises
:class:`runtime.errors.ContextOverflowError` under every policy.
"""
from __future__ import annotations

from typing import Callable, Sequence

from runtime.chat_format import Message
from runtime.errors import ContextOverflowError

OVERFLOW_POLICIES = ("stop", "truncate-middle", "rolling")

#: Messages (without the system prompt) -> prompt token ids (system prompt and template included).
Encode = Callable[[Sequence[Message]], list[int]]


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, messages ...)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drop_oldest_turns(encode: Encode, messages: Sequence[Message], target: int, tail: Sequence[int] = ()) -> list[int]:
    """``encode(kept) + tail`` after dropping the oldest turns until it fits in ``target`` tokens.

    A turn is a user message and the replies after it; the last message is always kept
    (the result may then still be longer than ``target``).
    """
    msgs = list(messages)
    ids = encode(msgs) + list(tail)
    while len(ids) > target and len(msgs) > 1:
        del msgs[0]
        while len(msgs) > 1 and msgs[0].role != "user":
            del msgs[0]
        ids = encode(msgs) + list(tail)
    return ids


def fit_prompt(encode: Encode, messages: Sequence[Message], *, limit: int, reserve: int, policy: str) -> tuple[list[int], int]:
    """The prompt ids for ``messages`` under ``policy``, and how many tokens were dropped.

    Args:
        encode: renders messages (the system prompt added) to token ids.
        messages: the conversation, ending with the message to reply to.
        limit: the context window (tokens).
        reserve: tokens truncate-middle keeps free for the reply.
        policy: one of :data:`OVERFLOW_POLICIES`. Only truncate-middle drops anything
            here; ``stop`` and ``rolling`` get the whole conversation (``stop`` then ends
            at once when it does not fit, ``rolling`` evicts while prefilling).

    Raises:
        ContextOverflowError: the last message needs ``limit`` tokens or more alone.
    """
    full = encode(messages)
    if len(full) < limit and (policy != "truncate-middle" or len(full) + reserve <= limit):
        return full, 0
    alone = encode(messages[-1:])
    if len(alone) >= limit:
        raise ContextOverflowError(
            f"the message needs {len(alone)} tokens with the chat template but the context holds "
            f"{limit}; shorten the message or raise the context length",
            prompt_tokens=len(alone), context_limit=limit,
        )
    if policy != "truncate-middle":
        return full, 0
    ids = drop_oldest_turns(encode, messages, max(limit - reserve, len(alone) + 1))
    if len(ids) >= limit:
        ids = alone
    return ids, len(full) - len(ids)


def rolling_window(limit: int, sink_tokens: int) -> int:
    """Tokens of the rolling window after the sinks (at least 1)."""
    return limit - min(sink_tokens, limit - 1)


def rolling_eviction(length: int, n_new: int, *, limit: int, sink_tokens: int) -> tuple[int, int] | None:
    """Cache slots ``[start, end)`` to evict so ``n_new`` more tokens fit, or ``None`` if they fit.

    Evicts at least a quarter of the window at once, so the shift and re-rotation of
    the kept keys happen once every ~window/4 decode steps instead of on every step.

    Raises:
        ValueError: ``n_new`` is larger than the window (no eviction can make room).
    """
    if length + n_new <= limit:
        return None
    sink = limit - rolling_window(limit, sink_tokens)
    window = limit - sink
    if n_new > window:
        raise ValueError(f"{n_new} new tokens do not fit a rolling window of {window}")
    n_evict = min(max(length + n_new - limit, window // 4), length - sink)
    return sink, sink + n_evict
