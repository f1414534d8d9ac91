"""Helpers for the ChatSession tests on the real default model.

An independent greedy loop (our model's ``logits`` on a fresh cache, plain argmax) is
the oracle for the session's token ids; ``run_turn`` drains a session's events and
watches the cache length at every one of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from runtime.generate.chat_format import Message, encode_messages
from runtime.generate.events import Finish, PrefillProgress, StatsUpdate, TextPiece


@dataclass
class Turn:
    """Everything one reply emitted, and the cache lengths seen while it ran."""

    finish: Finish
    pieces: list[str] = field(default_factory=list)
    progress: list[PrefillProgress] = field(default_factory=list)
    stats_updates: int = 0
    cache_lengths: list[int] = field(default_factory=list)  # at each event
    events: list = field(default_factory=list)

    def text_from(self, index: int) -> str:
        """The text of the pieces from event ``index`` on."""
        return "".join(ev.text for ev in self.events[index:] if isinstance(ev, TextPiece))

    @property
    def text(self) -> str:
        return self.finish.text

    @property
    def stats(self):
        return self.finish.stats


def run_turn(session, events: Iterator, on_event: Callable | None = None) -> Turn:
    """Drain ``events``; ``on_event(event, turn_so_far)`` runs after each event is recorded."""
    pieces: list[str] = []
    progress: list[PrefillProgress] = []
    lengths: list[int] = []
    seen: list = []
    n_stats = 0
    finish = None
    for ev in events:
        seen.append(ev)
        lengths.append(session.cache.length)
        if isinstance(ev, TextPiece):
            pieces.append(ev.text)
        elif isinstance(ev, PrefillProgress):
            progress.append(ev)
        elif isinstance(ev, StatsUpdate):
            n_stats += 1
        elif isinstance(ev, Finish):
            assert finish is None, "two Finish events"
            finish = ev
        if on_event is not None:
            on_event(ev, pieces, progress)
    assert finish is not None, "the event stream ended without a Finish"
    return Turn(finish, pieces, progress, n_stats, lengths, seen)


def conversation_ids(model, system: str | None, messages: list[Message]) -> list[int]:
    """The prompt ids of ``messages`` the way a session with ``system`` renders them."""
    sys_msgs = [Message("system", system)] if system else []
    return encode_messages(model.tokenizer, sys_msgs + list(messages))


@torch.inference_mode()
def greedy_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding on a fresh cache: the reply's ids (stop token excluded)."""
    cache = model.new_cache(len(prompt_ids) + max_new_tokens + 1)
    logits = model.logits(prompt_ids, cache, last_only=True)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(torch.argmax(logits[0, -1]))
        if token in model.stop_token_ids:
            break
        out.append(token)
        if len(out) < max_new_tokens:
            logits = model.logits([token], cache, last_only=True)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def assert_cache_starts_with(model, cache, ids: list[int], atol: float = 1e-4) -> None:
    """The first ``len(ids)`` cache slots hold exactly what prefilling ``ids`` from position 0 gives.

    Keys and values at slot ``i`` depend only on tokens ``0..i`` (causal), so this is
    true exactly when the cache's first tokens are ``ids`` at their original positions.
    """
    n = len(ids)
    assert cache.length >= n
    fresh = model.new_cache(n)
    model.logits(ids, fresh)
    for layer in (0, len(cache.k) // 2, len(cache.k) - 1):
        torch.testing.assert_close(cache.k[layer][:, :, :n], fresh.k[layer][:, :, :n], atol=atol, rtol=1e-4)
        torch.testing.assert_close(cache.v[layer][:, :, :n], fresh.v[layer][:, :, :n], atol=atol, rtol=1e-4)
