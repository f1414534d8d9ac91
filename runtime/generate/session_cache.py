"""The KV cache side of a chat session: prefix reuse, feeding tokens, overflow and cache policies.

Must not import Qt. :class:`SessionCache` is the base of
:class:`runtime.generate.session.ChatSession`; the policies themselves are computed in
:mod:`runtime.generate.context` (stop, truncate-middle, rolling) and
:mod:`runtime.cache.policies` (H2O, SnapKV, TOVA, key-norm, sinks + window); this module
applies them to the cache.
"""
from __future__ import annotations

import torch

from runtime.cache.policies.evictor import DEFAULT_STEP, Evictor, budget_for_bytes
from runtime.cache.policies.sinks_window import rolling_span
from runtime.generate.chat_format import encode_conversation, token_counter
from runtime.generate.context import (
    PromptCancelled,
    common_prefix_length,
    rolling_sinks,
    system_prompt_tokens,
    trim_conversation,
    unseen_messages,
)
from runtime.generate.events import TEXT_ROLE, TurnStats


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class SessionCache:
    """The KV cache side of :class:`runtime.generate.session.ChatSession`: the token stream the
    cache was built from, prefix reuse, feeding tokens, the overflow policies (rolling,
    truncate-middle) and the cache policy's evictor.

    A base class, not used alone: it reads the attributes ChatSession sets (``model``, ``settings``,
    ``cache``, ``context_limit``, ``evictor``, ``messages``, ``system_prompt``, ``_stream``, ``_slots``,
    ``_chunk``, ``_sinks``, ``_cancel``, ``_system_tokens``, ``_prompt_logits``) and its ``_encode``.
    """

    def _attach_policy(self, limit: int) -> Evictor | None:
        """The cache policy's evictor on :attr:`cache` (None: no policy, or a budget the
        conversation can never pass). Under a policy the conversation may run to ``limit``
        tokens: only the budget is cached, so the memory limit bounds the budget, not the
        context. A budget close to the memory limit reads a prompt in the chunks that fit beside it.
        """
        st = self.settings
        if st.cache_policy == "none":
            return None
        budgets = [st.cache_budget] if st.cache_budget is not None else []
        if st.cache_budget_bytes is not None:
            budgets.append(budget_for_bytes(self.cache, st.cache_budget_bytes))
        budget = min(budgets)
        if budget >= min(limit, self.cache.token_limit):
            return None  # never full: nothing to evict, no observing either
        # The budget is a ceiling: after each forward the cache holds at most ``budget`` tokens
        # (Evictor.within), plus a prompt chunk while it is read.
        evictor = Evictor.within(st.cache_policy, budget, step=DEFAULT_STEP)
        self._chunk = min(self._chunk, self.cache.token_limit - evictor.ceiling)   # >= 1: budget < token_limit
        self.context_limit = limit
        return evictor.attach(self.cache)

    @property
    def cached_token_ids(self) -> list[int]:
        """The token ids whose keys and values the cache holds, slot by slot
        (after a rolling eviction: the sinks, then the newest window). Under a cache
        policy each layer and head holds its own subset of the conversation: this is the
        whole conversation, in position order (:meth:`KVCache.positions` says which)."""
        return [self._stream[p] for p in self._slots]

    @property
    def evicted_tokens(self) -> int:
        """Tokens of the conversation the cache no longer holds (each full-attention layer)."""
        return len(self._stream) - self.cache.held_tokens

    # ---- the cache -----------------------------------------------------------------------
    def _sync_cache(self, ids: list[int], *, whole: bool = False, limit: int | None = None) -> int:
        """Crop the cache to its longest common prefix with ``ids`` (at most ``limit`` tokens);
        returns reused tokens.

        At least one token is left to prefill (its logits choose the next token), except
        with ``whole`` when ``ids`` is the prompt whose last logits are kept
        (``_prompt_logits``): then all of it is reused and the session takes those logits.
        """
        n = common_prefix_length(self._stream, ids)
        if limit is not None:
            n = min(n, max(limit, 0))
        kept = self._prompt_logits
        if not (whole and n == len(ids) and kept is not None and kept[0] == n):
            n = min(n, len(ids) - 1)  # always prefill at least one token to get logits
        if kept is not None and kept[0] > n:
            self._prompt_logits = None
        keep = sum(1 for p in self._slots if p < n)
        point = self.cache.crop_point(keep)
        if point < keep:
            # A cache policy evicted tokens before ``keep`` after the cache passed it: the
            # cache as it was at ``point`` is the latest one it still holds whole (what was
            # evicted is never taken for reused). Else a sliding-window layer no longer
            # holds the window before the crop point, or a rolling eviction renumbered the
            # slots: prefill again from the start.
            n = keep = point if point and self._slots[point - 1] == point - 1 else 0
        # Slots after an eviction gap are valid only if everything before them is.
        self.cache.crop(keep)
        del self._slots[keep:]
        del self._stream[n:]
        return n

    def _evict_for(self, n_new: int) -> None:
        """Rolling policy: make room for ``n_new`` tokens by removing a span after the sinks."""
        span = rolling_span(self.cache.length, n_new, limit=self.context_limit, sink_tokens=self._sinks)
        if span is None:
            return
        start, end = span
        self._prompt_logits = None  # the positions it was computed at move
        self.cache.remove_span(start, end)
        self.model.decoder.shift_key_positions(self.cache, start, self.cache.length, start - end)
        del self._slots[start:end]

    def _feed(self, ids: list[int], *, last_only: bool) -> torch.Tensor:
        """Run ``ids`` through the model, appending them to the cache."""
        base = len(self._stream)
        if len(ids) == 1:  # a decode step: the model's decode mode (a CUDA graph on a GPU)
            logits = self.model.decode_next(ids[0], self.cache)
        else:
            logits = self.model.logits(ids, self.cache, last_only=last_only)
        self._slots.extend(range(base, base + len(ids)))
        self._stream.extend(ids)
        if self.evictor is not None:  # after the forward: the newest queries choose (runtime.cache.policies.evictor)
            self.evictor.evict(self.cache)
        return logits

    def _step(self, generated: list[int], stats: TurnStats) -> torch.Tensor:
        """Decode the newest token, applying the overflow policy when the cache is full."""
        token = generated[-1]
        if self.cache.length + 1 > self.context_limit:
            policy = self.settings.overflow
            if policy == "rolling":
                self._evict_for(1)
            elif policy == "truncate-middle":
                return self._truncate_mid_reply(generated, stats)
            else:
                raise _Stop("context")
        return self._feed([token], last_only=True)

    def _truncate_mid_reply(self, generated: list[int], stats: TurnStats) -> torch.Tensor:
        """truncate-middle during a reply: drop the oldest turns, re-prefill prompt + reply so far.

        Raises:
            _Stop("context"): even the last message and the reply so far do not fit.
        """
        limit = self.context_limit
        remaining = self.settings.max_new_tokens - len(generated)
        target = limit - max(1, min(remaining, limit // 4))
        try:
            ids, dropped, self._first_kept = trim_conversation(self._encode, self.messages, target, tail=generated,
                                                               count=token_counter(self.model.tokenizer),
                                                               cancelled=self._cancel.is_set)
        except PromptCancelled:
            raise _Stop("cancelled") from None
        if len(ids) > limit:
            raise _Stop("context")
        # Dropped from the whole conversation (not added to the prompt's drop: both count from it).
        stats.dropped_tokens = dropped
        reused = self._sync_cache(ids)
        rest = ids[reused:]
        logits = None
        for i in range(0, len(rest), self._chunk):
            logits = self._feed(rest[i : i + self._chunk], last_only=True)
        return logits

    # ---- rolling: the system prompt with the sinks; what the model no longer sees ----------
    def _rolling_sinks(self) -> tuple[int, bool]:
        """(sink tokens for this reply, whether the system prompt is among them): see
        :func:`runtime.generate.context.rolling_sinks`."""
        st = self.settings
        key = (self.system_prompt, st.tools)
        if self.messages and self.messages[0].role == TEXT_ROLE:
            n = 0   # plain text: no system prompt
        else:
            if key not in self._system_tokens:
                self._system_tokens[key] = system_prompt_tokens(self._encode)
            n = self._system_tokens[key]
        return rolling_sinks(n, st.sink_tokens, self.context_limit, keep_system=st.keep_system_prompt)

    def _unseen_messages(self) -> int:
        msgs = [m for m in self.messages if m.role != TEXT_ROLE]
        return unseen_messages(self._slots, self._sinks, len(msgs), lambda k: len(encode_conversation(
            self.model.tokenizer, self._conversation(msgs[:k]), add_generation_prompt=False,
            tools=self.settings.tools or None).ids))

