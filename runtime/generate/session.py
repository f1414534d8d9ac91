"""A chat session: a conversation, its KV cache, and generation as a stream of typed events.

Must not import Qt. Each turn: render the conversation with the chat template ->
token ids -> longest common prefix with what the cache holds -> crop the cache
there -> prefill the rest in chunks (cancellable, with progress) -> decode.

The context-overflow policies (stop, truncate-middle, rolling) are described and
computed in :mod:`runtime.generate.context`; this module applies them to the cache. A
cache policy (H2O, SnapKV, TOVA, key-norm, sinks + window: :mod:`runtime.cache.eviction`)
keeps the cache within its budget by evicting after each forward pass
(:mod:`runtime.cache.evictor`); the prefix reuse then crops only to a point no later
eviction touched (:meth:`runtime.cache.kv_cache.KVCache.crop_point`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Iterator

import torch

from runtime.cache.evictor import DEFAULT_STEP, Evictor, budget_for_bytes
from runtime.errors import ContextOverflowError
from runtime.generate.chat_format import Message, encode_conversation, token_counter
from runtime.generate.context import (
    PromptCancelled,
    common_prefix_length,
    fit_prompt,
    rolling_eviction,
    rolling_sinks,
    rolling_window,
    system_prompt_tokens,
    trim_conversation,
    unseen_messages,
)
from runtime.generate.events import (
    TEXT_ROLE,
    Event,
    Finish,
    GenerationSettings,
    PrefillProgress,
    StatsUpdate,
    TextPiece,
    TurnStats,
)
from runtime.generate.sampling import Sampler
from runtime.generate.streaming import IncrementalDetokenizer, StopStringMatcher
from runtime.loader.model import Model

#: llama.cpp's default ``repeat_last_n``: the repetition penalty looks this far back (tokens).
REPEAT_LAST_N = 64


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class ChatSession:
    """One conversation with its KV cache.

    Args:
        model: a loaded :class:`runtime.loader.model.Model`.
        system_prompt: optional system message.
        settings: :class:`GenerationSettings`.

    Raises:
        ValueError: a context limit past the model's maximum, an unknown cache dtype.
        CacheLimitError: a cache limit below one token.
    """

    def __init__(self, model: Model, *, system_prompt: str | None = None, settings: GenerationSettings | None = None):
        self.model = model
        self.settings = settings or GenerationSettings()
        max_ctx = model.config.max_position_embeddings
        limit = self.settings.context_limit or max_ctx
        if limit > max_ctx:
            raise ValueError(f"a context of {limit} tokens passes the model's maximum of {max_ctx}; use at most {max_ctx}")
        self.context_limit = limit
        self.cache = model.new_cache(limit, dtype=self.settings.cache_dtype, limit_bytes=self.settings.cache_limit_bytes)
        self.context_limit = min(limit, self.cache.token_limit)
        self._chunk = self.settings.prefill_chunk
        self.evictor = self._attach_policy(limit)
        self.system_prompt = system_prompt
        self.messages: list[Message] = []
        # The logical token stream the cache was built from, and the logical position
        # of each cache slot (they differ only after a rolling eviction).
        self._stream: list[int] = []
        self._slots: list[int] = []
        self._cancel = threading.Event()
        self._sinks = self.settings.sink_tokens   # the rolling policy's sinks for the reply in progress
        self._system_tokens: dict[tuple, int] = {}
        self.last_logits: torch.Tensor | None = None  # logits that chose the first reply token
        self.last_stats: TurnStats | None = None

    def _attach_policy(self, limit: int) -> Evictor | None:
        """The cache policy's evictor on :attr:`cache` (None: no policy, or a budget the
        conversation can never pass). Under a policy the conversation may run to ``limit``
        tokens: only the budget is cached, so the memory limit bounds the budget, not the
        context.

        Raises:
            ValueError: a budget that leaves no room to read a prompt under the memory limit.
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
        # The cache holds up to budget + step - 1 tokens, plus a prompt chunk while it is read.
        room = self.cache.token_limit - (budget + DEFAULT_STEP - 1)
        if room < 1:
            raise ValueError(f"a cache budget of {budget} tokens leaves no room under the KV-cache memory limit "
                             f"({self.cache.token_limit} tokens); lower the budget or raise the limit")
        self._chunk = min(self._chunk, room)
        self.context_limit = limit
        return Evictor(st.cache_policy, budget, step=DEFAULT_STEP).attach(self.cache)

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

    # ---- conversation edits --------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the running reply to stop (thread-safe; takes effect within one step)."""
        self._cancel.set()

    def reset(self) -> None:
        """Forget the conversation and the cache (memory stays allocated)."""
        self.messages.clear()
        self._stream.clear()
        self._slots.clear()
        self.cache.reset()

    def send(self, text: str) -> Iterator[Event]:
        """Add a user message and generate the reply (appended to :attr:`messages` at the end).

        The events come lazily; iterating them raises :class:`ContextOverflowError` when
        the message cannot fit even alone (the conversation and cache are then unchanged).
        """
        before = list(self.messages)
        self.messages.append(Message("user", text))
        return self._generate(before)

    def reply(self) -> Iterator[Event]:
        """Generate the next message of :attr:`messages` as they stand.

        A conversation ending with a user message (or holding only the system prompt)
        gets a reply; one ending with an assistant message has that message continued
        (a prefill: the reply starts from its text, the new text is appended to it and
        only the new text is in the events). A conversation of one :data:`TEXT_ROLE`
        message is plain text, continued without any chat template (a text completion:
        the tokenizer's own special tokens, such as a BOS, are added; no system prompt).
        Raises as :meth:`send`.
        """
        return self._generate(list(self.messages))

    def regenerate(self) -> Iterator[Event]:
        """Drop the last reply and generate it again (the prompt is reused from the cache).

        Raises:
            ValueError: there is no user message to reply to.
        """
        before = list(self.messages)
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        if not self.messages:
            self.messages[:] = before
            raise ValueError("there is no message to regenerate a reply for")
        return self._generate(before)

    def edit_last_user(self, text: str) -> Iterator[Event]:
        """Replace the last user message (dropping replies after it) and generate.

        Raises:
            ValueError: the conversation has no user message.
        """
        idx = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if idx is None:
            raise ValueError("there is no user message to edit")
        return self.edit(idx, text)

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message ``index`` of :attr:`messages` with ``text``, drop every message
        after it, and generate the reply.

        The cache is reused up to the first token where the new prompt differs from what it
        holds (the system prompt and every turn before the edited message, and the edited
        message's own first tokens when they are unchanged); only the rest is prefilled.

        Raises:
            ValueError: ``index`` is not the position of a user message.
        """
        if not (0 <= index < len(self.messages)) or self.messages[index].role != "user":
            raise ValueError(f"message {index} is not a user message; edit one of "
                             f"{[i for i, m in enumerate(self.messages) if m.role == 'user']}")
        before = list(self.messages)
        del self.messages[index:]
        self.messages.append(Message("user", text))
        return self._generate(before)

    # ---- prompt assembly -----------------------------------------------------------------
    def _conversation(self, messages: list[Message]) -> list[Message]:
        sys_msgs = [Message("system", self.system_prompt)] if self.system_prompt else []
        return sys_msgs + messages

    def _stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.settings.stop_strings if s)

    def _encode(self, messages: list[Message]) -> list[int]:
        """Prompt ids: each reply's own token ids spliced in (:func:`runtime.generate.chat_format.encode_conversation`)."""
        if messages and messages[0].role == TEXT_ROLE:  # a plain text completion (see reply())
            return list(self.model.tokenizer.encode("".join(m.content for m in messages)))
        return self._encoded(messages).ids

    def _retokenized(self, messages: list[Message]) -> int:
        if messages and messages[0].role == TEXT_ROLE:
            return 0
        return self._encoded(messages).retokenized_tokens

    def _encoded(self, messages: list[Message]):
        # A conversation ending with an assistant message is one to continue (see reply()).
        cont = bool(messages) and messages[-1].role == "assistant"
        return encode_conversation(self.model.tokenizer, self._conversation(list(messages)),
                                   add_generation_prompt=not cont, continue_final=cont,
                                   tools=self.settings.tools or None)

    # ---- the cache -----------------------------------------------------------------------
    def _sync_cache(self, ids: list[int]) -> int:
        """Crop the cache to its longest common prefix with ``ids``; returns reused tokens."""
        n = min(common_prefix_length(self._stream, ids), len(ids) - 1)  # always prefill at least one token to get logits
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
        """Rolling policy: make room for ``n_new`` tokens by evicting after the sinks."""
        span = rolling_eviction(self.cache.length, n_new, limit=self.context_limit, sink_tokens=self._sinks)
        if span is None:
            return
        start, end = span
        self.cache.evict(start, end)
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
        if self.evictor is not None:  # after the forward: the newest queries choose (runtime.cache.evictor)
            self.evictor.evict(self.cache)
        return logits

    # ---- generation ----------------------------------------------------------------------
    def _generate(self, before: list[Message]) -> Iterator[Event]:
        # Clear a stale cancel now, not at the first next(): a cancel() that arrives
        # between send() and the first event must still stop this reply.
        self._cancel.clear()
        return self._events(before)

    def _events(self, before: list[Message]) -> Iterator[Event]:
        st = self.settings
        t_start = time.perf_counter()
        stats = TurnStats(context_limit=self.context_limit)
        self.last_logits = None
        reserve = min(st.max_new_tokens, self.context_limit // 2)
        try:
            prompt, dropped = fit_prompt(self._encode, self.messages, limit=self.context_limit,
                                         reserve=reserve, policy=st.overflow,
                                         count=token_counter(self.model.tokenizer), cancelled=self._cancel.is_set)
        except ContextOverflowError:
            self.messages[:] = before  # a message that can never fit leaves no trace
            raise
        except PromptCancelled:  # stopped while a long conversation was being trimmed
            prompt, dropped = None, 0
        stats.prompt_tokens, stats.dropped_tokens = len(prompt or ()), dropped
        if prompt is not None and any(m.role == "assistant" for m in self.messages):
            stats.retokenized_tokens = self._retokenized(self.messages)
        if st.overflow == "rolling" and prompt is not None:
            self._sinks, stats.system_kept = self._rolling_sinks()
            stats.sink_tokens = self._sinks
        detok = IncrementalDetokenizer(self.model.tokenizer)
        stops = StopStringMatcher(self._stop_strings())
        sampler = Sampler(st.sampling)
        shown: list[str] = []
        generated: list[int] = []
        reason = "stop"
        logits = None
        try:
            if prompt is None:
                raise _Stop("cancelled")
            if st.overflow == "stop" and len(prompt) >= self.context_limit:
                raise _Stop("context")
            reused = self._sync_cache(prompt)
            stats.reused_tokens = reused
            rest = prompt[reused:]
            t_prefill = time.perf_counter()
            done = 0
            yield PrefillProgress(0, len(rest))
            while done < len(rest):
                if self._cancel.is_set():
                    raise _Stop("cancelled")
                size = self._chunk
                if self.evictor is not None:
                    # Chunks end at multiples of the chunk size whatever was reused, so a prompt
                    # read again after a crop is evicted at the same points as the first time.
                    size -= (reused + done) % self._chunk
                chunk = rest[done : done + size]
                if st.overflow == "rolling":
                    chunk = chunk[: rolling_window(self.context_limit, self._sinks)]
                    self._evict_for(len(chunk))
                logits = self._feed(chunk, last_only=True)
                done += len(chunk)
                stats.prefilled_tokens = done  # what the cache really took, if cancelled below
                yield PrefillProgress(done, len(rest))
            prefill_s = time.perf_counter() - t_prefill
            stats.prefill_tokens_per_s = len(rest) / prefill_s if prefill_s > 0 else 0.0
            self.last_logits = logits[0, -1].clone()
            yield StatsUpdate(self._snapshot(stats))
            t_decode = None
            n_steps = 0
            while True:
                recent = (self._stream[-REPEAT_LAST_N:]) if st.sampling.repetition_penalty != 1.0 else None
                row = logits[0, -1]
                for process in st.logits_processors:
                    row = process(generated, row)
                token = sampler(row, recent)
                if not generated:
                    stats.ttft_s = time.perf_counter() - t_start
                    t_decode = time.perf_counter()
                if token in self.model.stop_token_ids:
                    raise _Stop("stop")
                generated.append(token)
                piece, hit = stops.push(detok.push(token))
                if piece:
                    shown.append(piece)
                    yield TextPiece(piece)
                if hit:
                    raise _Stop("stop")
                if len(generated) >= st.max_new_tokens:
                    raise _Stop("length")
                if self._cancel.is_set():
                    raise _Stop("cancelled")
                length_before = self.cache.length
                logits = self._step(generated, stats)
                n_steps += 1
                stats.decode_tokens_per_s = n_steps / max(time.perf_counter() - t_decode, 1e-9)
                stats.completion_tokens = len(generated)
                # Every few tokens (a live memory chart redraws several times a second),
                # and at once when an eviction or truncation shrank the cache.
                if n_steps % 4 == 0 or self.cache.length <= length_before:
                    yield StatsUpdate(self._snapshot(stats))
        except _Stop as s:
            reason = s.reason
        if reason != "stop" or not stops.stopped:
            # A reply cut inside a character (length, cancel) ends with its bytes undecodable:
            # show the complete characters only, never U+FFFD.
            piece, hit = stops.push(detok.flush().rstrip("\ufffd"))
            tail = piece + ("" if hit else stops.flush())
            if tail:
                shown.append(tail)
                yield TextPiece(tail)
        text = "".join(shown)
        stats.completion_tokens = len(generated)
        if self.messages and self.messages[-1].role in ("assistant", TEXT_ROLE):  # a continued text
            self.messages[-1] = Message(self.messages[-1].role, self.messages[-1].content + text)
        elif text or reason in ("stop", "length"):
            self.messages.append(Message("assistant", text, self._written_ids(generated, text, detok.text)))
        if reason == "length" and generated and detok.text == text and self.cache.length < self.context_limit:
            # A length stop sampled its last token but never fed it (the loop stops before the
            # step): feed it now, one decode step, so the cache holds the whole reply and the
            # next turn prefills only the template's end-of-turn and the new message. A Stop
            # (cancel) does not: it ends at once, and the next turn prefills that one token.
            self._feed([generated[-1]], last_only=True)
        if st.overflow == "rolling":
            stats.unseen_messages = self._unseen_messages()
        self.last_stats = self._snapshot(stats)
        yield Finish(reason, text, self.last_stats, tuple(generated))

    def _written_ids(self, generated: list[int], text: str, decoded: str) -> tuple[int, ...] | None:
        """The reply's ids to keep with its text: all of them when they decode to exactly the
        text; without the last ones when those only held bytes of a character the reply was
        cut inside (a length stop or Stop: the text drops them); ``None`` when the text lost
        more (a stop string)."""
        if decoded == text:
            return tuple(generated)
        if decoded.startswith(text) and set(decoded[len(text):]) == {"\ufffd"}:
            for k in range(len(generated) - 1, -1, -1):
                head = self.model.tokenizer.decode(generated[:k], skip_special_tokens=True)
                if head == text:
                    return tuple(generated[:k])
                if not head.startswith(text):
                    break
        return None

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
            ids, dropped = trim_conversation(self._encode, self.messages, target, tail=generated,
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

    def _snapshot(self, stats: TurnStats) -> TurnStats:
        governor = self.model.decode_threads
        threads = {} if governor is None else dict(decode_threads=governor.choice, max_threads=governor.options[0])
        return replace(stats, kv_cache=self.cache.stats(), evicted_tokens=self.evicted_tokens, **threads)

    def run(self, events: Iterator[Event]) -> Finish:
        """Drain an event stream and return its :class:`Finish` (for callers that do not stream)."""
        finish = None
        for ev in events:
            if isinstance(ev, Finish):
                finish = ev
        assert finish is not None
        return finish
