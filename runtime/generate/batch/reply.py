"""One request's reply among the batch: prompt ids in, typed events out, one step at a time.

Must not import Qt. The steps of :class:`runtime.generate.session.ChatSession`'s loop, cut
where the batch needs them: the scheduler feeds the prompt chunk by chunk
(:meth:`BatchReply.next_chunk`), hands over each step's logits row (:meth:`BatchReply.choose`),
and the reply picks its token with its own sampler and logits processors, streams its text
(UTF-8-safe, stop strings held back) and says when it has ended. The events are the session's
(:mod:`runtime.generate.events`), so a caller reads a batched reply as it reads a session's.

The overflow policy is ``stop``: a prompt that fills the context is refused before it runs
(the caller's check), and a reply that reaches the context ends with ``"context"``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runtime.cache.paged import PagedSequence
from runtime.generate.events import Event, Finish, LogitsProcessor, PrefillProgress, TextPiece, TurnStats
from runtime.generate.sampling import Sampler, SamplingParams
from runtime.generate.streaming import IncrementalDetokenizer, StopStringMatcher

#: llama.cpp's default ``repeat_last_n``: the repetition penalty looks this far back (tokens).
REPEAT_LAST_N = 64


@dataclass(frozen=True)
class ReplyRequest:
    """What one reply needs.

    Attributes:
        prompt: the prompt's token ids (the chat template applied), at least one.
        sampling: how to pick tokens.
        max_new_tokens: most tokens in the reply (at least 1).
        stop_strings: texts that end the reply (not shown).
        logits_processors: per-step hooks made for this reply alone (grammar, penalties, logprobs).
        context_limit: the most tokens prompt and reply may take together.
        salt: whose cached prefixes the reply may share (the server's partition).
        share_limit: the most prompt tokens it may take from pages other replies wrote (the
            server's reuse rule: an earlier whole prompt it extends); None: no limit.

    Raises:
        ValueError: an empty prompt, ``max_new_tokens`` below 1, a prompt that fills the context.
    """

    prompt: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 512
    stop_strings: tuple[str, ...] = ()
    logits_processors: tuple[LogitsProcessor, ...] = ()
    context_limit: int = 2048
    salt: str = ""
    share_limit: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a reply needs a prompt of at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be at least 1; got {self.max_new_tokens}")
        if len(self.prompt) >= self.context_limit:
            raise ValueError(f"a prompt of {len(self.prompt)} tokens fills the context of {self.context_limit}")

    @property
    def most_tokens(self) -> int:
        """The most tokens its sequence can hold: prompt plus reply, within the context."""
        return min(len(self.prompt) + self.max_new_tokens, self.context_limit)


class BatchReply:
    """The state of one reply: ``"waiting"`` -> ``"prefill"`` -> ``"decode"`` -> ``"done"``.

    Args:
        model: the loaded model (its tokenizer and stop tokens).
        request: the :class:`ReplyRequest`.
        seq: its paged sequence (empty; :meth:`start` takes a shared prefix into it).
    """

    def __init__(self, model, request: ReplyRequest, seq: PagedSequence):
        self.model, self.request, self.seq = model, request, seq
        self.state = "waiting"
        self.generated: list[int] = []
        self.pending: int | None = None  # the sampled token the next decode step feeds
        self.stats = TurnStats(context_limit=request.context_limit, prompt_tokens=len(request.prompt))
        self._detok = IncrementalDetokenizer(model.tokenizer)
        self._stops = StopStringMatcher(tuple(s for s in request.stop_strings if s))
        self._sampler = Sampler(request.sampling)
        self._shown: list[str] = []
        self._done = 0  # prompt tokens in the sequence
        self._t0 = time.perf_counter()
        self._t_prefill = self._t_decode = 0.0
        #: The :class:`Finish` once the reply has ended.
        self.finish: Finish | None = None
        #: Keep the sequence's pages when the reply ends (not cancelled): the caller then owns
        #: :attr:`seq` (a donor for the next turn's prefix) and releases it.
        self.keep_pages = False
        self._tail = False  # the reply's length is reached; its last token is being fed

    # ---- prefill -----------------------------------------------------------------------
    def start(self, donor: PagedSequence | None = None) -> list[Event]:
        """Take what can be shared of the prompt (from a ``donor`` with the longest common
        prefix, else the pool's prefix index) and begin the prefill. A donor that holds this
        whole prompt with its last logits (the same request again) gives them too: nothing is
        prefilled and the first token is chosen now, from the logits the first prefill left (a
        one-token step would reduce in another order and could flip a greedy near-tie)."""
        prompt, limit = list(self.request.prompt), self.request.share_limit
        whole = donor is not None and donor.prompt_logits is not None and donor.prompt_logits[0] == len(prompt) \
            and (limit is None or limit >= len(prompt)) and donor.tokens[: len(prompt)] == prompt
        if whole and self.seq.fork(donor, len(prompt)) == len(prompt):
            self.seq.prompt_logits = donor.prompt_logits
            self._done = self.stats.reused_tokens = len(prompt)
            self.state = "decode"
            return [PrefillProgress(0, 0)] + self.choose(donor.prompt_logits[1].clone())  # processors edit rows
        most = len(prompt) - 1 if limit is None else min(len(prompt) - 1, limit)
        reused = 0
        if donor is not None and most > 0:
            reused = self.seq.fork(donor, _common(donor.tokens, prompt, most))
        if reused == 0 and most > 0:
            reused = self.seq.adopt(prompt, most)
        self._done = self.stats.reused_tokens = reused
        self.state = "prefill"
        self._t_prefill = time.perf_counter()
        return [PrefillProgress(0, len(prompt) - reused)]

    def next_chunk(self, size: int) -> list[int]:
        """The next at most ``size`` prompt ids to feed (the sequence takes them)."""
        return list(self.request.prompt[self._done : self._done + size])

    def fed(self, ids: list[int], logits: torch.Tensor) -> list[Event]:
        """``ids`` (from :meth:`next_chunk`) went into the sequence; ``logits (V,)``: its last
        row. After the prompt's last chunk the first token is chosen."""
        self.seq.record(ids)
        self._done += len(ids)
        rest = len(self.request.prompt) - self.stats.reused_tokens
        self.stats.prefilled_tokens = self._done - self.stats.reused_tokens
        events: list[Event] = [PrefillProgress(self.stats.prefilled_tokens, rest)]
        if self._done == len(self.request.prompt):
            elapsed = time.perf_counter() - self._t_prefill
            self.stats.prefill_tokens_per_s = rest / elapsed if elapsed > 0 else 0.0
            self.state = "decode"
            if self.keep_pages:  # kept with the sequence: the same request again starts from them
                self.seq.prompt_logits = (self._done, logits.clone())
            events += self.choose(logits)
        return events

    # ---- decode ------------------------------------------------------------------------
    def choose(self, logits: torch.Tensor) -> list[Event]:
        """Pick the next token from ``logits (V,)`` (float32): processors, sampler, stop token,
        stop strings, the limits; the text it shows; the :class:`Finish` when it ends."""
        if self.pending is not None:  # the token just fed is now in the sequence
            self.seq.record([self.pending])
            self.pending = None
        if self._tail:  # the last token of a length stop has been fed: the cache holds the whole reply
            return self.end("length")
        req = self.request
        recent = None
        if req.sampling.repetition_penalty != 1.0:
            recent = (self.seq.tokens[-REPEAT_LAST_N:])
        row = logits
        for process in req.logits_processors:
            row = process(self.generated, row)
        token = self._sampler(row, recent)
        if not self.generated:
            self.stats.ttft_s = time.perf_counter() - self._t0
            self._t_decode = time.perf_counter()
        if token in self.model.stop_token_ids:
            return self.end("stop")
        self.generated.append(token)
        events: list[Event] = []
        piece, hit = self._stops.push(self._detok.push(token))
        if piece:
            self._shown.append(piece)
            events.append(TextPiece(piece))
        if hit:
            return events + self.end("stop")
        if len(self.generated) >= req.max_new_tokens:
            if self.keep_pages and self._detok.text == "".join(self._shown) and self.seq.length < self.seq.max_tokens:
                # Fed in the next step before the reply ends, as a session does, so the next
                # turn reuses the whole reply (a stop string or a cut character: not).
                self.pending, self._tail = token, True
                return events
            return events + self.end("length")
        if self.seq.length + 1 > req.context_limit:
            return events + self.end("context")
        self.pending = token
        return events

    def end(self, reason: str) -> list[Event]:
        """End the reply now (``reason``: stop, length, context, cancelled): the held-back
        text, the figures, the :class:`Finish`; the pages go back to the pool (unless
        :attr:`keep_pages` and not cancelled)."""
        if self.finish is not None:
            return []
        events: list[Event] = []
        if reason != "stop" or not self._stops.stopped:
            piece, hit = self._stops.push(self._detok.flush().rstrip("\ufffd"))
            tail = piece + ("" if hit else self._stops.flush())
            if tail:
                self._shown.append(tail)
                events.append(TextPiece(tail))
        s = self.stats
        s.completion_tokens = len(self.generated)
        if self._t_decode and len(self.generated) > 1:
            s.decode_tokens_per_s = (len(self.generated) - 1) / max(time.perf_counter() - self._t_decode, 1e-9)
        s.kv_cache = self.kv_figures()
        if reason == "cancelled" or not self.keep_pages:
            self.seq.release()
        self.pending = None
        self.state = "done"
        self.finish = Finish(reason, "".join(self._shown), s, tuple(self.generated))
        return events + [self.finish]

    def fail(self) -> None:
        """The reply raised: it ends without a :class:`Finish`, its pages go back to the pool."""
        self.seq.release()
        self.pending = None
        self.state = "done"

    def kv_figures(self) -> dict:
        """The sequence's and the pool's page figures (JSON-ready): the session's ``kv_cache``
        keys (dtype, bytes_per_token, tokens, used_bytes, allocated_bytes, limit_bytes) and
        ``pages`` (this sequence's pages, its shared ones, the pool's counts)."""
        pool, mine = self.seq.pool, self.seq.stats()
        p = pool.stats()
        return {"dtype": p["dtype"], "bytes_per_token": pool.layer_bytes_per_token * pool.n_layers,
                "tokens": mine["tokens"], "used_bytes": mine["used_bytes"], "allocated_bytes": p["allocated_bytes"],
                "limit_bytes": p["limit_bytes"],
                "pages": {"page_tokens": p["page_tokens"], "bytes_per_page": p["bytes_per_page"],
                          "sequence": mine["pages"], "sequence_shared": mine["shared_pages"],
                          "used": p["pages_used"], "shared": p["pages_shared"], "cached": p["pages_cached"],
                          "free": p["pages_free"], "total": p["pages_total"]}}


def _common(a: list[int], b: list[int], most: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= most:
            break
        n += 1
    return n
