"""Context-overflow policies: what a chat session does when the conversation outgrows the context.

Must not import Qt (nor torch: these are pure functions over token ids and messages;
:mod:`runtime.generate.session` applies them to its KV cache).

- ``stop``: the reply ends with finish reason ``"context"``.
- ``truncate-middle``: keep the system prompt and the newest turns, drop the oldest
  turns in between (before the reply, and again while it runs), re-prefill what
  changed; the session reports the tokens dropped from the conversation.
- ``rolling``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models
  with Attention Sinks", arXiv:2309.17453): keep the first ``sink_tokens`` tokens and a
  window of the newest; cut the middle from the cache (the span:
  :func:`runtime.cache.policies.sinks_window.rolling_span`, the same StreamingLLM as the
  ``sinks-window`` cache policy). The sinks reach the end of the
  system prompt by default (:func:`rolling_sinks`), so the model keeps its instructions;
  the session reports how many messages it no longer sees (:func:`unseen_messages`). Positions: keys are cached
  after RoPE, and after a cut the kept keys are re-rotated by minus the removed
  count (RoPE rotations compose), so cache slot ``i`` always holds position ``i`` and
  the model never sees a position past the window. Re-rotation over caching keys before
  RoPE: it costs one rotation per cut instead of one per cached key on every decode step.

A message that cannot fit even alone (with the system prompt and the template) raises
:class:`runtime.errors.ContextOverflowError` under every policy.
"""
from __future__ import annotations

from typing import Callable, Sequence

from runtime.errors import ContextOverflowError
from runtime.generate.chat_format import Message

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


class PromptCancelled(Exception):
    """The conversation was being trimmed when the caller cancelled (nothing changed)."""


#: Texts -> their token counts, each text alone (no template): a fast estimate of a
#: message's size, e.g. :func:`runtime.generate.chat_format.token_counter`.
Count = Callable[[Sequence[str]], list[int]]

#: Conversations whose estimate passes this many times the context are trimmed without
#: rendering them whole first (the estimate is within a few tokens per message; 2x leaves
#: room for a template that adds more than it).
RENDER_WHOLE_FACTOR = 2


def _turn_starts(messages: Sequence[Message]) -> list[int]:
    """Where a kept conversation may begin: the start, each user message, the last message."""
    n = len(messages)
    return sorted({0, n - 1} | {i for i in range(1, n) if messages[i].role == "user"})


def _estimates(encode: Encode, messages: Sequence[Message], count: Count) -> tuple[int, list[int]]:
    """(fixed tokens, tokens per message): ``encode(messages[i:])`` is about ``fixed + sum(per[i:])``.

    Each message's text is counted once (``count``); what the template adds per message
    of each role, and once per prompt (system prompt, generation prompt), is measured by
    encoding a few one-word messages.
    """
    user, reply = Message("user", "x"), Message("assistant", "x")
    x = count(["x"])[0]
    one = len(encode([user]))
    added = {"user": len(encode([user, reply, user])) - len(encode([user, reply])) - x,
             "assistant": len(encode([user, reply])) - one - x}
    other = max(added.values())
    per = [n + max(0, added.get(m.role, other)) for m, n in zip(messages, count([m.content for m in messages]))]
    return one - x - max(0, added["user"]), per


def _trim(encode: Encode, messages: Sequence[Message], target: int, tail: Sequence[int], *,
          count: Count | None, cancelled: Callable[[], bool] | None,
          guess: tuple[int, list[int]] | None = None) -> tuple[int, list[int]]:
    """(first kept message, ``encode(kept) + tail``) for the longest run of whole turns that fits.

    Finds the earliest turn start whose rendering fits ``target`` by a search over the
    turn starts, not by dropping one turn at a time: a few encodes of at most the kept
    part when the sizes are estimated (``count``), about log2(turns) encodes without.
    Assumes that fewer messages never render to more tokens.

    Raises:
        PromptCancelled: ``cancelled()`` turned true between encodes.
    """
    msgs = list(messages)
    starts = _turn_starts(msgs)
    budget = target - len(tail)
    encoded: dict[int, list[int]] = {}

    def fits(i: int) -> bool:
        if i == len(starts) - 1:
            return True  # the last message is always kept, fitting or not
        if i not in encoded:
            if cancelled is not None and cancelled():
                raise PromptCancelled()
            encoded[i] = encode(msgs[starts[i]:])
        return len(encoded[i]) <= budget

    # lo: a start known not to fit (-1: none), hi: one known to fit.
    lo, hi = -1, len(starts) - 1
    if count is not None and len(starts) > 2:
        fixed, per = guess or _estimates(encode, msgs, count)
        suffix, total = {}, fixed
        for i in range(len(msgs) - 1, -1, -1):
            total += per[i]
            suffix[i] = total
        g = next(i for i, s in enumerate(starts) if suffix[s] <= budget or i == len(starts) - 1)
        # Gallop from the estimate to a start that fits and one that does not ...
        step = 1
        if fits(g):
            hi = g
            while hi - step >= 0 and fits(hi - step):
                hi -= step
                step *= 2
            lo = max(hi - step, -1)
        else:
            lo = g
            while not fits(min(lo + step, hi)):
                lo += step
                step *= 2
            hi = min(lo + step, hi)
    while hi - lo > 1:  # ... then bisect between them
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    ids = encoded.get(hi)
    if ids is None:
        ids = encode(msgs[starts[hi]:])
    return starts[hi], list(ids) + list(tail)


def drop_oldest_turns(encode: Encode, messages: Sequence[Message], target: int, tail: Sequence[int] = (), *,
                      count: Count | None = None, cancelled: Callable[[], bool] | None = None) -> list[int]:
    """``encode(kept) + tail`` after dropping the oldest turns until it fits in ``target`` tokens.

    A turn is a user message and the replies after it; the last message is always kept
    (the result may then still be longer than ``target``). ``count`` (texts -> token
    counts) lets a long conversation be trimmed in a few encodes of the kept part;
    ``cancelled`` is checked between encodes.

    Raises:
        PromptCancelled: ``cancelled()`` turned true.
    """
    return _trim(encode, messages, target, tail, count=count, cancelled=cancelled)[1]


def trim_conversation(encode: Encode, messages: Sequence[Message], target: int, tail: Sequence[int] = (), *,
                      count: Count | None = None, cancelled: Callable[[], bool] | None = None
                      ) -> tuple[list[int], int, int]:
    """:func:`drop_oldest_turns`, the tokens it dropped from the whole conversation, and the
    index of the first message it kept (0: none dropped).

    The count is exact when the conversation is rendered whole (up to
    :data:`RENDER_WHOLE_FACTOR` times ``target``, or without ``count``); past that, the
    dropped messages are estimated (their texts counted, the template's additions
    measured) rather than rendered.

    Raises:
        PromptCancelled: ``cancelled()`` turned true.
    """
    guess = _estimates(encode, messages, count) if count is not None and len(messages) > 2 else None
    whole = None
    if guess is None or guess[0] + sum(guess[1]) <= RENDER_WHOLE_FACTOR * target:
        ids = encode(messages)
        whole = len(ids)
        if whole + len(tail) <= target:
            return list(ids) + list(tail), 0, 0
    start, ids = _trim(encode, messages, target, tail, count=count, cancelled=cancelled, guess=guess)
    kept = len(ids) - len(tail)
    if whole is None:
        whole = kept + sum(guess[1][:start])
    return ids, whole - kept, start


def fit_prompt(encode: Encode, messages: Sequence[Message], *, limit: int, reserve: int, policy: str,
               count: Count | None = None, cancelled: Callable[[], bool] | None = None) -> tuple[list[int], int, int]:
    """The prompt ids for ``messages`` under ``policy``, how many tokens were dropped, and the
    index of the first message kept (truncate-middle drops whole messages from the start; 0:
    none dropped).

    Args:
        encode: renders messages (the system prompt added) to token ids.
        messages: the conversation, ending with the message to reply to.
        limit: the context window (tokens).
        reserve: tokens truncate-middle keeps free for the reply.
        policy: one of :data:`OVERFLOW_POLICIES`. Only truncate-middle drops anything
            here; ``stop`` and ``rolling`` get the whole conversation (``stop`` then ends
            at once when it does not fit, ``rolling`` evicts while prefilling).
        count: texts -> token counts; with it, a conversation far past the context is
            trimmed without being rendered whole (see :func:`trim_conversation`).
        cancelled: checked between encodes while trimming.

    Raises:
        ContextOverflowError: the last message needs ``limit`` tokens or more alone.
        PromptCancelled: ``cancelled()`` turned true while trimming.
    """
    alone = encode(messages[-1:])
    if len(alone) >= limit:
        raise ContextOverflowError(
            f"the message needs {len(alone):,} tokens with the chat template but the context holds "
            f"{limit:,}; shorten the message or raise the context length",
            prompt_tokens=len(alone), context_limit=limit,
        )
    if policy != "truncate-middle":
        return encode(messages), 0, 0
    ids, dropped, first = trim_conversation(encode, messages, max(limit - reserve, len(alone) + 1),
                                            count=count, cancelled=cancelled)
    if len(ids) >= limit:
        ids, dropped, first = alone, dropped + len(ids) - len(alone), len(messages) - 1
    return ids, dropped, first


def system_prompt_tokens(encode: Encode) -> int:
    """Tokens a conversation's rendering holds before its first message's text: the system
    prompt (set, or the chat template's own), its end and the first message's header. Found as
    the common start of two one-message conversations that differ only in that text."""
    return common_prefix_length(encode([Message("user", "a")]), encode([Message("user", "b")]))


def rolling_sinks(system_tokens: int, sink_tokens: int, limit: int, *, keep_system: bool = True) -> tuple[int, bool]:
    """(sink tokens, whether the system prompt is among them) for the rolling policy.

    StreamingLLM keeps the first tokens as attention sinks (Xiao et al. 2023); making them the
    system prompt's (``system_tokens``, :func:`system_prompt_tokens`) keeps the model's
    instructions however long the conversation runs. Not when the system prompt takes more
    than half of the ``limit``-token context: the rolling window would be too short; then
    only ``sink_tokens`` stay, and the system prompt is evicted after them.
    """
    if system_tokens <= sink_tokens:
        return sink_tokens, True
    if not keep_system or system_tokens > limit // 2:
        return sink_tokens, False
    return system_tokens, True


def unseen_messages(slots: Sequence[int], sinks: int, n_messages: int, rendered_length: Callable[[int], int]) -> int:
    """How many messages, from the first, the model no longer sees at all after rolling
    evictions: ``slots`` are the stream positions the cache holds (the sinks, a gap, the
    newest window); ``rendered_length(k)`` is the length of the conversation's first ``k``
    messages rendered (with the system prompt). A binary search: ``log2(n_messages)`` renders."""
    if len(slots) <= sinks or slots[sinks] == sinks:
        return 0   # nothing evicted
    first_kept = slots[sinks]
    lo, hi = 0, n_messages
    while lo < hi:   # the most messages whose rendering ends before the first kept token
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if rendered_length(mid) <= first_kept else (lo, mid - 1)
    return lo
