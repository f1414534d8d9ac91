"""A chat session: a conversation, its KV cache, and generation as a stream of typed events.

Must not import Qt. Each turn: render the conversation with the chat template ->
token ids -> longest common prefix with what the cache holds -> crop the cache
there -> prefill the rest in chunks (cancellable, with progress) -> decode.

The context-overflow policies (stop, truncate-middle, rolling) are described and
computed in :mod:`runtime.generate.context` and applied, one object per policy, by
:mod:`runtime.generate.overflow`; the session owns its cache's side as a part
(:class:`runtime.generate.session_cache.CacheControl`, ``session.kv``). A reply's events come
in four steps: the prompt, the prefill, the decode, the finish. A
cache policy (H2O, SnapKV, TOVA, key-norm, sinks + window: :mod:`runtime.cache.policies`)
keeps the cache within its budget by evicting after each forward pass
(:mod:`runtime.cache.policies.evictor`); the prefix reuse then crops only to a point no later
eviction touched (:meth:`runtime.cache.kv_cache.KVCache.crop_point`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from runtime.cache.kv_cache import KVCache
from runtime.cache.policies.evictor import Evictor
from runtime.errors import ChatTemplateError, ContextOverflowError, ModelFileChanged
from runtime.generate.chat_format import Message, encode_conversation
from runtime.generate.context import PromptCancelled
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
from runtime.generate.overflow import EndReply, Overflow, overflow_policy
from runtime.generate.sampling import Sampler
from runtime.generate.session_cache import CacheControl
from runtime.generate.streaming import IncrementalDetokenizer, StopStringMatcher
from runtime.loader.model import Model

#: llama.cpp's default ``repeat_last_n``: the repetition penalty looks this far back (tokens).
REPEAT_LAST_N = 64


@dataclass
class _Turn:
    """One reply in progress: what its steps hand on to each other."""

    overflow: Overflow
    prompt: list[int] | None
    stats: TurnStats
    t_start: float
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    sampler: Sampler
    shown: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


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
        #: The KV cache's side: the cache, the stream it holds, prefix reuse, feeding, eviction.
        self.kv = CacheControl(model, self.settings)
        self.system_prompt = system_prompt
        self.messages: list[Message] = []
        self._cancel = threading.Event()
        self._first_kept = 0   # truncate-middle: the first message the prompt kept
        self._system_tokens: dict[tuple, int] = {}
        self.last_logits: torch.Tensor | None = None  # logits that chose the first reply token
        self.last_stats: TurnStats | None = None

    @property
    def cache(self) -> KVCache:
        """The conversation's KV cache (settable: another cache of the model's shape, held empty
        or matching :attr:`cached_token_ids`)."""
        return self.kv.cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self.kv.cache = cache

    @property
    def context_limit(self) -> int:
        """Tokens the conversation may hold (under a cache policy: more than the cache holds)."""
        return self.kv.context_limit

    @property
    def evictor(self) -> Evictor | None:
        """The cache policy's evictor (None: no policy, or a budget never passed)."""
        return self.kv.evictor

    @property
    def cached_token_ids(self) -> list[int]:
        """:attr:`runtime.generate.session_cache.CacheControl.cached_token_ids`."""
        return self.kv.cached_token_ids

    @property
    def evicted_tokens(self) -> int:
        """Tokens of the conversation the cache no longer holds (each full-attention layer)."""
        return self.kv.evicted_tokens

    @property
    def stream_length(self) -> int:
        """Tokens of the conversation the cache was built from (its logical length: after a
        rolling eviction more than the cache holds)."""
        return len(self.kv.stream)

    # ---- conversation edits --------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the running reply to stop (thread-safe; takes effect within one step)."""
        self._cancel.set()

    def reset(self) -> None:
        """Forget the conversation and the cache (memory stays allocated)."""
        self.messages.clear()
        self.kv.reset()

    def send(self, text: str) -> Iterator[Event]:
        """Add a user message and generate the reply (appended to :attr:`messages` at the end).

        The events come lazily; iterating them raises :class:`ContextOverflowError` when
        the message cannot fit even alone (the conversation and cache are then unchanged).
        """
        before = list(self.messages)
        self.messages.append(Message("user", text))
        return self._generate(before)

    def reply(self, *, max_reuse: int | None = None) -> Iterator[Event]:
        """Generate the next message of :attr:`messages` as they stand.

        A conversation ending with a user message (or holding only the system prompt)
        gets a reply; one ending with an assistant message has that message continued
        (a prefill: the reply starts from its text, the new text is appended to it and
        only the new text is in the events). A conversation of one :data:`TEXT_ROLE`
        message is plain text, continued without any chat template (a text completion:
        the tokenizer's own special tokens, such as a BOS, are added; no system prompt).
        ``max_reuse``: reuse at most this many cached tokens (the server's rule of what one
        request may reuse of another's, :mod:`attnchat.server.engine`). Raises as :meth:`send`.
        """
        return self._generate(list(self.messages), max_reuse)

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

    def prompt_ids(self) -> list[int]:
        """The token ids the next :meth:`reply` would read for :attr:`messages` (the chat
        template applied, or a plain text's own; before any overflow policy)."""
        return self._encode(list(self.messages))

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

    # ---- generation ----------------------------------------------------------------------
    def _generate(self, before: list[Message], max_reuse: int | None = None) -> Iterator[Event]:
        # Clear a stale cancel now, not at the first next(): a cancel() that arrives
        # between send() and the first event must still stop this reply.
        self._cancel.clear()
        return self._events(before, max_reuse)

    def _events(self, before: list[Message], max_reuse: int | None = None) -> Iterator[Event]:
        turn = self._prompt(before)
        reason = "stop"
        try:
            logits = yield from self._prefill(turn, max_reuse)
            yield from self._decode(turn, logits)
        except EndReply as s:
            reason = s.reason
        yield from self._finish(turn, reason)

    def _prompt(self, before: list[Message]) -> _Turn:
        """The prompt step: the model file checked, the conversation fitted to the context.

        Raises:
            ModelFileChanged, ContextOverflowError, ChatTemplateError: :attr:`messages` put back
                to ``before`` first.
        """
        try:
            self.model.check_file()  # a file changed under the app: said, not answered from
        except ModelFileChanged:
            self.messages[:] = before
            raise
        st = self.settings
        overflow = overflow_policy(st.overflow)
        t_start = time.perf_counter()
        stats = TurnStats(context_limit=self.context_limit)
        self.last_logits = None
        try:
            prompt, dropped, self._first_kept = overflow.fit(self, reserve=min(st.max_new_tokens, self.context_limit // 2))
        except ContextOverflowError:
            self.messages[:] = before  # a message that can never fit leaves no trace
            raise
        except PromptCancelled:  # stopped while a long conversation was being trimmed
            prompt, dropped, self._first_kept = None, 0, 0
        if prompt is not None and not prompt:  # a template and tokenizer that give no token
            self.messages[:] = before
            raise ChatTemplateError("the model's chat template and tokenizer turned this conversation into no "
                                    "tokens; pick another model or fix its template")
        stats.prompt_tokens, stats.dropped_tokens = len(prompt or ()), dropped
        if prompt is not None and any(m.role == "assistant" for m in self.messages):
            stats.retokenized_tokens = self._retokenized(self.messages)
        return _Turn(overflow, prompt, stats, t_start, IncrementalDetokenizer(self.model.tokenizer),
                     StopStringMatcher(self._stop_strings()), Sampler(st.sampling))

    def _prefill(self, turn: _Turn, max_reuse: int | None) -> Iterator[Event]:
        """The prefill step: reuse the cached prefix, read the rest in chunks; returns the
        logits ``(1, 1, V)`` of the prompt's last token.

        Raises:
            EndReply: cancelled, or the prompt does not fit (``stop``).
        """
        kv, prompt, stats = self.kv, turn.prompt, turn.stats
        if prompt is None:
            raise EndReply("cancelled")
        turn.overflow.begin(self, prompt, stats)
        reused = kv.sync(prompt, whole=True, limit=max_reuse)
        stats.reused_tokens = reused
        rest = prompt[reused:]
        logits = None
        if not rest:  # the whole prompt is cached with its last logits
            logits = kv.prompt_logits[1].clone().view(1, 1, -1)  # processors may edit a row in place
        t_prefill = time.perf_counter()
        done = 0
        yield PrefillProgress(0, len(rest))
        while done < len(rest):
            if self._cancel.is_set():
                raise EndReply("cancelled")
            chunk = turn.overflow.chunk(self, rest[done : done + kv.chunk_at(reused + done)])
            logits = kv.feed(chunk, last_only=True)
            done += len(chunk)
            stats.prefilled_tokens = done  # what the cache really took, if cancelled below
            yield PrefillProgress(done, len(rest))
        prefill_s = time.perf_counter() - t_prefill
        stats.prefill_tokens_per_s = len(rest) / prefill_s if prefill_s > 0 else 0.0
        self.last_logits = logits[0, -1].clone()
        if rest:
            kv.prompt_logits = (len(kv.stream), self.last_logits)
        yield StatsUpdate(self._snapshot(stats))
        return logits

    def _decode(self, turn: _Turn, logits: torch.Tensor) -> Iterator[Event]:
        """The decode step: sample, stream the text, feed the token, until :class:`EndReply`."""
        st, stats, generated = self.settings, turn.stats, turn.generated
        t_decode = None
        n_steps = 0
        while True:
            recent = (self.kv.stream[-REPEAT_LAST_N:]) if st.sampling.repetition_penalty != 1.0 else None
            row = logits[0, -1]
            for process in st.logits_processors:
                row = process(generated, row)
            token = turn.sampler(row, recent)
            if not generated:
                stats.ttft_s = time.perf_counter() - turn.t_start
                t_decode = time.perf_counter()
            if token in self.model.stop_token_ids:
                raise EndReply("stop")
            generated.append(token)
            piece, hit = turn.stops.push(turn.detok.push(token))
            if piece:
                turn.shown.append(piece)
                yield TextPiece(piece)
            if hit:
                raise EndReply("stop")
            if len(generated) >= st.max_new_tokens:
                raise EndReply("length")
            if self._cancel.is_set():
                raise EndReply("cancelled")
            length_before = self.cache.length
            if self.cache.length + 1 > self.context_limit:  # the overflow policy makes room, or ends the reply
                logits = turn.overflow.full(self, generated, stats)
            else:
                logits = self.kv.feed([token], last_only=True)
            n_steps += 1
            stats.decode_tokens_per_s = n_steps / max(time.perf_counter() - t_decode, 1e-9)
            stats.completion_tokens = len(generated)
            # Every few tokens (a live memory chart redraws several times a second),
            # and at once when an eviction or truncation shrank the cache.
            if n_steps % 4 == 0 or self.cache.length <= length_before:
                yield StatsUpdate(self._snapshot(stats))

    def _finish(self, turn: _Turn, reason: str) -> Iterator[Event]:
        """The finish step: the text's tail, the reply kept in :attr:`messages`, the stats."""
        stats, generated, stops, detok, shown = turn.stats, turn.generated, turn.stops, turn.detok, turn.shown
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
            self.kv.feed([generated[-1]], last_only=True)
        stats.unseen_messages = turn.overflow.unseen(self)
        stats.unseen_policy = turn.overflow.name if stats.unseen_messages else ""
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
