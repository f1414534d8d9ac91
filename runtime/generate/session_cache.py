"""The KV cache side of a chat session: the cache it owns, prefix reuse, feeding tokens, the
rolling cut and the cache policy's evictor.

Must not import Qt. :class:`CacheControl` is a part :class:`runtime.generate.session.ChatSession`
owns (``session.kv``); it knows the model, the settings and the cache, not the conversation.
The overflow policies that call it are :mod:`runtime.generate.overflow` (the pure functions
behind them: :mod:`runtime.generate.context`); the cache policies are
:mod:`runtime.cache.policies`.
"""
from __future__ import annotations

import torch

from runtime.cache.policies.evictor import DEFAULT_STEP, Evictor, budget_for_bytes
from runtime.cache.policies.sinks_window import rolling_span
from runtime.generate.context import common_prefix_length
from runtime.generate.events import GenerationSettings


class CacheControl:
    """A conversation's KV cache and the token stream it was built from.

    Args:
        model: a loaded :class:`runtime.loader.model.Model`.
        settings: the session's :class:`GenerationSettings` (context, cache dtype and limit,
            prefill chunk, cache policy, sinks).

    Raises:
        ValueError: a context limit past the model's maximum, an unknown cache dtype.
        CacheLimitError: a cache limit below one token.
    """

    def __init__(self, model, settings: GenerationSettings):
        self.model = model
        max_ctx = model.config.max_position_embeddings
        limit = settings.context_limit or max_ctx
        if limit > max_ctx:
            raise ValueError(f"a context of {limit} tokens passes the model's maximum of {max_ctx}; use at most {max_ctx}")
        self.cache = model.new_cache(limit, dtype=settings.cache_dtype, limit_bytes=settings.cache_limit_bytes)
        #: Tokens the conversation may hold (under a cache policy: past what the cache holds).
        self.context_limit = min(limit, self.cache.token_limit)
        #: Prefill chunk in tokens (smaller beside a cache policy's budget close to the limit).
        self.chunk = settings.prefill_chunk
        self.evictor = self._attach_policy(settings, limit)
        #: The logical token stream the cache was built from, and the logical position of
        #: each cache slot (they differ only after a rolling cut).
        self.stream: list[int] = []
        self.slots: list[int] = []
        #: The rolling policy's sinks for the reply in progress.
        self.sinks = settings.sink_tokens
        # (stream length, logits (V,)) of the last prompt's last token: a prompt the cache
        # holds whole (Regenerate, the same request again) reuses them instead of feeding
        # its last token again as a one-token step, whose products reduce in another order
        # than the prefill's and can flip a greedy near-tie.
        self.prompt_logits: tuple[int, torch.Tensor] | None = None

    def _attach_policy(self, st: GenerationSettings, limit: int) -> Evictor | None:
        """The cache policy's evictor on :attr:`cache` (None: no policy, or a budget the
        conversation can never pass). Under a policy the conversation may run to ``limit``
        tokens: only the budget is cached, so the memory limit bounds the budget, not the
        context. A budget close to the memory limit reads a prompt in the chunks that fit beside it.
        """
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
        self.chunk = min(self.chunk, self.cache.token_limit - evictor.ceiling)   # >= 1: budget < token_limit
        self.context_limit = limit
        return evictor.attach(self.cache)

    @property
    def cached_token_ids(self) -> list[int]:
        """The token ids whose keys and values the cache holds, slot by slot
        (after a rolling eviction: the sinks, then the newest window). Under a cache
        policy each layer and head holds its own subset of the conversation: this is the
        whole conversation, in position order (:meth:`KVCache.positions` says which)."""
        return [self.stream[p] for p in self.slots]

    @property
    def evicted_tokens(self) -> int:
        """Tokens of the conversation the cache no longer holds (each full-attention layer)."""
        return len(self.stream) - self.cache.held_tokens

    def reset(self) -> None:
        """Forget the stream and the cache (memory stays allocated)."""
        self.stream.clear()
        self.slots.clear()
        self.prompt_logits = None
        self.cache.reset()

    def chunk_at(self, done: int) -> int:
        """The size of the prefill chunk that starts ``done`` tokens into the stream. Under a cache
        policy chunks end at multiples of the chunk size whatever was reused, so a prompt read
        again after a crop is evicted at the same points as the first time."""
        return self.chunk - (done % self.chunk if self.evictor is not None else 0)

    # ---- the cache -----------------------------------------------------------------------
    def sync(self, ids: list[int], *, whole: bool = False, limit: int | None = None) -> int:
        """Crop the cache to its longest common prefix with ``ids`` (at most ``limit`` tokens);
        returns reused tokens.

        At least one token is left to prefill (its logits choose the next token), except
        with ``whole`` when ``ids`` is the prompt whose last logits are kept
        (:attr:`prompt_logits`): then all of it is reused and the session takes those logits.
        """
        n = common_prefix_length(self.stream, ids)
        if limit is not None:
            n = min(n, max(limit, 0))
        kept = self.prompt_logits
        if not (whole and n == len(ids) and kept is not None and kept[0] == n):
            n = min(n, len(ids) - 1)  # always prefill at least one token to get logits
        if kept is not None and kept[0] > n:
            self.prompt_logits = None
        keep = sum(1 for p in self.slots if p < n)
        point = self.cache.crop_point(keep)
        if point < keep:
            # A cache policy evicted tokens before ``keep`` after the cache passed it: the
            # cache as it was at ``point`` is the latest one it still holds whole (what was
            # evicted is never taken for reused). Else a sliding-window layer no longer
            # holds the window before the crop point, or a rolling eviction renumbered the
            # slots: prefill again from the start.
            n = keep = point if point and self.slots[point - 1] == point - 1 else 0
        # Slots after an eviction gap are valid only if everything before them is.
        self.cache.crop(keep)
        del self.slots[keep:]
        del self.stream[n:]
        return n

    def roll(self, n_new: int) -> None:
        """The rolling policy's cut: make room for ``n_new`` tokens by removing a span after the sinks."""
        span = rolling_span(self.cache.length, n_new, limit=self.context_limit, sink_tokens=self.sinks)
        if span is None:
            return
        start, end = span
        self.prompt_logits = None  # the positions it was computed at move
        self.cache.remove_span(start, end)
        self.model.decoder.shift_key_positions(self.cache, start, self.cache.length, start - end)
        del self.slots[start:end]

    def feed(self, ids: list[int], *, last_only: bool) -> torch.Tensor:
        """Run ``ids`` through the model, appending them to the cache; logits ``(1, T or 1, V)``."""
        base = len(self.stream)
        if len(ids) == 1:  # a decode step: the model's decode mode (a CUDA graph on a GPU)
            logits = self.model.decode_next(ids[0], self.cache)
        else:
            logits = self.model.logits(ids, self.cache, last_only=last_only)
        self.slots.extend(range(base, base + len(ids)))
        self.stream.extend(ids)
        if self.evictor is not None:  # after the forward: the newest queries choose (runtime.cache.policies.evictor)
            self.evictor.evict(self.cache)
        return logits
