"""The context-overflow policies as objects: what a chat session does, at each step of a reply,
when the conversation outgrows the context (stop, truncate-middle, rolling).

Must not import Qt. What each policy means and the pure functions behind it are
:mod:`runtime.generate.context`; a policy here applies them to a session
(:class:`runtime.generate.session.ChatSession`, passed in) at four points of a reply: the
prompt (:meth:`Overflow.fit`, :meth:`Overflow.begin`), each prefill chunk (:meth:`Overflow.chunk`),
a decode step the cache cannot take (:meth:`Overflow.full`), and the finish
(:meth:`Overflow.unseen`). :func:`overflow_policy` gives the one object per name.
"""
from __future__ import annotations

from runtime.cache.policies.sinks_window import rolling_window
from runtime.generate.chat_format import encode_conversation, token_counter
from runtime.generate.context import (
    OVERFLOW_POLICIES,
    PromptCancelled,
    fit_prompt,
    rolling_sinks,
    system_prompt_tokens,
    trim_conversation,
    unseen_messages,
)
from runtime.generate.events import TEXT_ROLE, TurnStats


class EndReply(Exception):
    """The reply ends here, for ``reason`` (a :class:`runtime.generate.events.Finish` reason)."""

    def __init__(self, reason: str):
        self.reason = reason


class Overflow:
    """``stop``: the whole conversation is the prompt; a prompt or a reply that reaches the
    context ends the reply with ``"context"``."""

    name = "stop"

    def fit(self, session, *, reserve: int) -> tuple[list[int], int, int]:
        """(prompt ids, tokens dropped, first message kept): :func:`runtime.generate.context.fit_prompt`.

        Raises:
            ContextOverflowError, PromptCancelled: as ``fit_prompt``.
        """
        return fit_prompt(session._encode, session.messages, limit=session.context_limit, reserve=reserve,
                          policy=self.name, count=token_counter(session.model.tokenizer),
                          cancelled=session._cancel.is_set)

    def begin(self, session, prompt: list[int], stats: TurnStats) -> None:
        """Before the prompt is read: refuse it or set up the reply (``stop``: the prompt must
        leave room for one token)."""
        if len(prompt) >= session.context_limit:
            raise EndReply("context")

    def chunk(self, session, chunk: list[int]) -> list[int]:
        """The part of a prefill chunk to feed now, room made for it."""
        return chunk

    def full(self, session, generated: list[int], stats: TurnStats):
        """The cache cannot take the next token: its logits after making room, or :class:`EndReply`."""
        raise EndReply("context")

    def unseen(self, session) -> int:
        """Messages the model no longer sees after this reply."""
        return 0


class TruncateMiddle(Overflow):
    """``truncate-middle``: drop the oldest turns before the reply and again while it runs."""

    name = "truncate-middle"

    def begin(self, session, prompt: list[int], stats: TurnStats) -> None:
        pass

    def full(self, session, generated: list[int], stats: TurnStats):
        """Drop the oldest turns and prefill prompt + reply so far again.

        Raises:
            EndReply("context"): even the last message and the reply so far do not fit.
        """
        kv, limit = session.kv, session.context_limit
        remaining = session.settings.max_new_tokens - len(generated)
        target = limit - max(1, min(remaining, limit // 4))
        try:
            ids, dropped, session._first_kept = trim_conversation(
                session._encode, session.messages, target, tail=generated,
                count=token_counter(session.model.tokenizer), cancelled=session._cancel.is_set)
        except PromptCancelled:
            raise EndReply("cancelled") from None
        if len(ids) > limit:
            raise EndReply("context")
        # Dropped from the whole conversation (not added to the prompt's drop: both count from it).
        stats.dropped_tokens = dropped
        rest = ids[kv.sync(ids):]
        logits = None
        for i in range(0, len(rest), kv.chunk):
            logits = kv.feed(rest[i : i + kv.chunk], last_only=True)
        return logits

    def unseen(self, session) -> int:
        return sum(1 for m in session.messages[:session._first_kept] if m.role != TEXT_ROLE)


class Rolling(Overflow):
    """``rolling``: StreamingLLM's sinks and newest window; the middle is cut from the cache."""

    name = "rolling"

    def begin(self, session, prompt: list[int], stats: TurnStats) -> None:
        st = session.settings
        if session.messages and session.messages[0].role == TEXT_ROLE:
            n = 0   # plain text: no system prompt
        else:
            key = (session.system_prompt, st.tools)
            if key not in session._system_tokens:
                session._system_tokens[key] = system_prompt_tokens(session._encode)
            n = session._system_tokens[key]
        session.kv.sinks, stats.system_kept = rolling_sinks(n, st.sink_tokens, session.context_limit,
                                                            keep_system=st.keep_system_prompt)
        stats.sink_tokens = session.kv.sinks

    def chunk(self, session, chunk: list[int]) -> list[int]:
        chunk = chunk[: rolling_window(session.context_limit, session.kv.sinks)]
        session.kv.roll(len(chunk))
        return chunk

    def full(self, session, generated: list[int], stats: TurnStats):
        session.kv.roll(1)
        return session.kv.feed([generated[-1]], last_only=True)

    def unseen(self, session) -> int:
        msgs = [m for m in session.messages if m.role != TEXT_ROLE]
        tok, tools = session.model.tokenizer, session.settings.tools or None
        return unseen_messages(session.kv.slots, session.kv.sinks, len(msgs), lambda k: len(encode_conversation(
            tok, session._conversation(msgs[:k]), add_generation_prompt=False, tools=tools).ids))


#: One object per name, in the order of :data:`runtime.generate.context.OVERFLOW_POLICIES`.
_POLICIES = {p.name: p for p in (Overflow(), TruncateMiddle(), Rolling())}


def overflow_policy(name: str) -> Overflow:
    """The policy object named ``name`` (one of :data:`runtime.generate.context.OVERFLOW_POLICIES`).

    Raises:
        ValueError: an unknown name.
    """
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown overflow policy {name!r}; use one of {', '.join(OVERFLOW_POLICIES)}") from None
