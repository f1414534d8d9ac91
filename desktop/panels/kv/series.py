"""The KV-cache panel's data: the series of cache sizes a conversation went through
(:class:`KVSeries`, plain numbers the tests read) and the overflow policy's next step in
words (:func:`policy_next`). No widgets; must not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["KVSeries", "MAX_POINTS", "policy_next"]

#: Most points kept per series (older ones are thinned by half when it is passed).
MAX_POINTS = 4000


@dataclass
class KVSeries:
    """What the chart shows, as plain numbers (the tests read it)."""

    conv_id: int | None = None
    request: int | None = None
    dtype: str = ""
    bytes_per_token: int = 0
    tokens: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)        # bytes
    allocated: list[int] = field(default_factory=list)   # bytes
    events: list[tuple[int, int, str]] = field(default_factory=list)  # (tokens before, after, kind)
    context_limit: int = 0
    limit_bytes: int | None = None
    dropped_tokens: int = 0
    #: (tokens, used bytes, allocated bytes) while a prompt is read (stats marked ``prefill``):
    #: drawn after the points above, and dropped when the reply's own stats come (they say
    #: what was reused, truncated or evicted, which the prompt's progress does not).
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    prefill: dict | None = None   # {"done", "total"} prompt tokens while a prompt is read
    sink_tokens: int = 0          # rolling: the sinks the last reply kept (the system prompt's), 0: unknown
    #: Under a cache policy: the bytes a full cache would take at each point of ``tokens``
    #: (``kv_cache["full_bytes"]``; equal to ``used`` while nothing is evicted), and the
    #: newest figures: tokens the cache holds, tokens evicted.
    full: list[int] = field(default_factory=list)
    held: int = 0
    evicted: int = 0
    #: The reply's tokens written (``completion_tokens``) at the newest point; None: unknown.
    completion: int | None = None
    _before: int | None = None   # the conversation's length before the prompt being read (for a truncation)

    def add(self, stats: dict, policy: str) -> tuple[int, int, str] | None:
        """Record one stats dict; returns the truncation or eviction it shows, if any."""
        kv = stats.get("kv_cache") or {}
        if "tokens" not in kv:
            return None
        # x is the conversation's length: under a cache policy the cache holds fewer tokens
        # (kv["tokens"]) than the conversation has (kv["positions"]).
        tokens = int(kv.get("positions", kv["tokens"]))
        held, evicted = int(kv["tokens"]), int(kv.get("evicted_tokens") or 0)
        bpt = int(kv.get("bytes_per_token") or 0)
        dtype = str(kv.get("dtype") or "")
        conv, request = stats.get("conv_id"), stats.get("request")
        if conv != self.conv_id or (bpt, dtype) != (self.bytes_per_token, self.dtype):
            self.__init__()  # another conversation or another cache: start again
        self.conv_id, self.dtype, self.bytes_per_token = conv, dtype, bpt
        self.context_limit = int(stats.get("context_limit") or self.context_limit)
        self.limit_bytes = kv.get("limit_bytes")
        self.sink_tokens = int(stats.get("sink_tokens") or self.sink_tokens)
        if stats.get("prefill"):
            if request != self.request and not self.pending and self.tokens:
                # A new prompt is read into the cache cropped to what it shares with the old
                # one (an edit, a regenerate, a truncation): the line past it is no longer the cache.
                self._before = self.tokens[-1]
                self.cut(tokens)
            self.prefill = dict(stats["prefill"])
            self.pending.append((tokens, int(kv.get("used_bytes", tokens * bpt)),
                                 int(kv.get("allocated_bytes", tokens * bpt))))
            return None
        self.pending, self.prefill = [], None
        self.held, self.evicted = held, evicted
        full = int(kv.get("full_bytes", kv.get("used_bytes", tokens * bpt)))
        dropped = int(stats.get("dropped_tokens") or 0)
        event = None
        if request != self.request:
            before = self._before if self._before is not None else (self.tokens[-1] if self.tokens else None)
            self._before = None
            if "reused_tokens" in stats:
                # A new reply kept only the prefix its prompt shares with the cache (an edit or a
                # regenerate crops it; a truncation drops the oldest turns and reads the rest again;
                # a new model or an evicted session keeps nothing): the line shows what the cache
                # holds now, so what was cut goes from the chart.
                self.cut(int(stats["reused_tokens"] or 0))
            if dropped and before is not None and tokens < before:   # the oldest turns were dropped
                event = (before, tokens, "truncated")
                self.events.append(event)
        elif self.tokens and tokens < self.tokens[-1]:   # within a reply: only the overflow policy shrinks it
            event = self._shrink(tokens, stats.get("completion_tokens"), policy)
            self.events.append(event)
        self.request, self.dropped_tokens = request, dropped
        self.completion = None if stats.get("completion_tokens") is None else int(stats["completion_tokens"])
        if not self.tokens or tokens != self.tokens[-1] or event:
            self.tokens.append(tokens)
            self.used.append(int(kv.get("used_bytes", tokens * bpt)))
            self.allocated.append(int(kv.get("allocated_bytes", tokens * bpt)))
            self.full.append(full)
        else:  # same length (a final stats dict): keep the newest byte counts
            self.used[-1] = int(kv.get("used_bytes", tokens * bpt))
            self.allocated[-1] = int(kv.get("allocated_bytes", tokens * bpt))
            self.full[-1] = full
        if len(self.tokens) > MAX_POINTS:
            for name in ("tokens", "used", "allocated", "full"):
                setattr(self, name, getattr(self, name)[::2])
        return event

    def _shrink(self, tokens: int, completion, policy: str) -> tuple[int, int, str]:
        """The event of a cache that shrank within a reply: ``(length when cut, length right
        after, kind)``. Points come every few decoded tokens, so the last point is not where the
        rolling policy cut: the reply's tokens written since (``completion_tokens``) say how
        long the cache grew before it, and so how many tokens went (the forecast's figure; the
        points' difference was short by the tokens written between them)."""
        before = self.tokens[-1]
        if policy != "rolling":
            return before, tokens, "truncated"
        if completion is None or self.completion is None:
            return before, tokens, "evicted"
        removed = before + int(completion) - self.completion - tokens
        cut_at = tokens + removed - 1   # the cut came before the newest token was written
        return cut_at, cut_at - removed, "evicted"

    @property
    def evicting(self) -> bool:
        """Whether a cache policy has evicted tokens of this conversation (the full line differs)."""
        return self.evicted > 0 or any(f > u for f, u in zip(self.full, self.used))

    def now(self) -> tuple[int, int, int] | None:
        """The newest (tokens, used bytes, allocated bytes), a prompt being read included; None: none."""
        if self.pending:
            return self.pending[-1]
        return (self.tokens[-1], self.used[-1], self.allocated[-1]) if self.tokens else None

    def cut(self, tokens: int) -> None:
        """Forget the points past ``tokens`` (the cache was cropped to that length), and the
        truncations and evictions that happened past it."""
        while self.tokens and self.tokens[-1] > tokens:
            for name in ("tokens", "used", "allocated", "full"):
                getattr(self, name).pop()
        self.events = [e for e in self.events if e[1] <= tokens]


def policy_next(policy: str, tokens: int, limit: int, sink_tokens: int, system: bool = False) -> str:
    """What the overflow policy does when the context fills (one sentence); ``system``: the
    rolling policy's sinks are the system prompt's tokens."""
    left = max(limit - tokens, 0)
    when = f"In {left:,} tokens" if left else "Now"
    if policy == "stop":
        return f"{when} the context is full: the reply stops (finish reason “context”)."
    if policy == "rolling":
        sink = min(sink_tokens, max(limit - 1, 0))
        chunk = max((limit - sink) // 4, 1)
        sinks = "the system prompt, kept as attention sinks" if system else "attention sinks"
        return (f"{when} the context is full: rolling evicts the oldest {chunk:,} tokens after the "
                f"first {sink:,} ({sinks}), then keeps going.")
    return f"{when} the context is full: truncate-middle drops the oldest turns (the system prompt stays)."

