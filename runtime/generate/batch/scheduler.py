"""Continuous batching: which replies run, and one step of all of them.

Must not import Qt. One :meth:`Batcher.step` is one turn of the engine (Orca's
iteration-level scheduling; vLLM's scheduler without preemption):

1. Admit waiting replies while fewer than ``max_batch`` run and the pool's memory holds the
   worst case of every admitted one (prompt plus its reply limit, :meth:`PagePool.bytes_for`):
   a running reply then never finds the pool full.
2. Feed prompt chunks, oldest reply first, up to ``prefill_chunk`` tokens a step: a long
   prompt is read over several steps while the others keep decoding, and several short ones
   are read in one step (one prompt a step made four 64-token prompts sent at once wait 1, 2,
   3 and 4 prefills with a decode step of the others between each). A reply's chunks are
   always ``prefill_chunk`` tokens from where its own prefill starts (the last one shorter),
   as alone, so its logits are the same: one that does not fit the step's remaining tokens waits for
   the next step. Before its first chunk a reply takes what it can share: a live reply's
   prefix (:meth:`PagedSequence.fork`), else the pool's cached pages of its prefix
   (:meth:`PagedSequence.adopt`); the replies before it have read their prompts by then.
3. Decode every reply with a pending token in one call over a batch of rows (one ggml graph,
   :mod:`runtime.model.ggml_batch`, when the model and pool take it, else
   :func:`runtime.model.batch_step.decode_rows`); each picks its own next token. On the CPU
   the call runs on the thread count a governor per batch size picks by timing (the model's
   decode counts, :class:`runtime.kernels.threads.ThreadGovernor`): with another program on
   a core, two threads made every step wait for the starved one (1.3 against 6.7 tok/s for
   llama.cpp's server on a loaded 2-core machine).

A reply that ends (stop, length, context) or is cancelled gives its pages back at once.
Everything runs on the caller's thread; :meth:`Batcher.cancel` is for that thread too (the
server's engine checks its cancel flags between steps).
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from runtime.cache.paged import PagePool, PagedSequence
from runtime.generate.batch.reply import BatchReply, ReplyRequest
from runtime.generate.events import Event
from runtime.kernels.threads import ThreadGovernor
from runtime.model.batch_step import decode_rows
from runtime.model.ggml_batch import BatchGraphs
from runtime.model.ggml_batch import unsupported as ggml_unsupported

log = logging.getLogger(__name__)

#: Replies decoding together unless told (a setting of the server).
MAX_BATCH = 8
#: Prompt tokens per prefill step.
PREFILL_CHUNK = 128


class Batcher:
    """Replies over one model and one page pool, stepped together.

    Args:
        model: the loaded model.
        pool: its :class:`runtime.cache.paged.PagePool`.
        max_batch: the most replies running at once (at least 1).
        prefill_chunk: prompt tokens fed per step (at least 1).
        on_events: called with ``(reply, events)`` for every reply that has new events.
        on_failed: called with ``(reply, error)`` for a reply that raised (a logits processor,
            the pool): it has ended and given its pages back; the others go on.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, model, pool: PagePool, *, max_batch: int = MAX_BATCH, prefill_chunk: int = PREFILL_CHUNK,
                 on_events: Callable[[BatchReply, list[Event]], None] | None = None,
                 on_failed: Callable[[BatchReply, Exception], None] | None = None):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be at least 1; got {max_batch}, {prefill_chunk}")
        self.model, self.pool = model, pool
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.on_events, self.on_failed = on_events, on_failed
        self.waiting: deque[BatchReply] = deque()
        self.running: list[BatchReply] = []  # admitted, oldest first
        #: Finished sequences the caller keeps (their pages held): donors of a prefix, as running ones are.
        self.donors: list[PagedSequence] = []
        #: Steps run and the rows each decode step had (for the stats: the batch sizes seen).
        self.steps = 0
        self.rows_decoded = 0
        self._governors: dict[int, ThreadGovernor] = {}  # rows per step -> its thread governor (CPU)
        self._ggml: BatchGraphs | bool | None = None  # None: not decided yet; False: eager rows

    # ---- requests ----------------------------------------------------------------------
    def add(self, request: ReplyRequest) -> BatchReply:
        """Queue a reply; it is admitted at a later :meth:`step`.

        Raises:
            ValueError: its worst case cannot fit the pool even alone (it would never run).
        """
        if self.pool.limit_bytes is not None and self.pool.bytes_for(request.most_tokens) > self.pool.limit_bytes:
            raise ValueError(f"a reply of up to {request.most_tokens} tokens needs "
                             f"{self.pool.bytes_for(request.most_tokens):,} bytes of KV pages but the pool holds "
                             f"{self.pool.limit_bytes:,}; lower max_tokens or raise the memory limit")
        reply = BatchReply(self.model, request, PagedSequence(self.pool, request.most_tokens, salt=request.salt))
        self.waiting.append(reply)
        return reply

    def cancel(self, reply: BatchReply) -> None:
        """End ``reply`` now with ``"cancelled"`` (waiting or running): its pages are freed at once."""
        if reply in self.waiting:
            self.waiting.remove(reply)
        elif reply in self.running:
            self.running.remove(reply)
        else:
            return
        self._emit(reply, reply.end("cancelled"))

    @property
    def busy(self) -> bool:
        """Whether any reply waits or runs."""
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Admit, feed prompt chunks, decode every running reply once (see the module)."""
        self.steps += 1
        self._admit()
        budget = self.prefill_chunk
        for reading in [r for r in self.running if r.state in ("waiting", "prefill")]:
            try:
                if reading.state == "waiting":  # its turn to read: share what the others hold now
                    self._emit(reading, reading.start(self._donor(reading)))
                if reading.state == "prefill":  # (a prompt held whole with its logits needs none)
                    ids = reading.next_chunk(self.prefill_chunk)
                    if len(ids) > budget:
                        break
                    budget -= len(ids)
                    logits = self.model.logits(ids, reading.seq, last_only=True)[0, -1]
                    self._emit(reading, reading.fed(ids, logits))
                    if reading.state == "prefill":  # more of its prompt next step; the later ones wait
                        break
            except Exception as e:  # this reply's, not the others'
                self._fail(reading, e)
        rows = [r for r in self.running if r.state == "decode" and r.pending is not None]
        if rows:
            self.rows_decoded += len(rows)
            try:
                logits = self._decode(rows)
            except Exception as e:  # every row's step failed: their sequences no longer match their tokens
                for r in rows:
                    self._fail(r, e)
            else:
                for b, r in enumerate(rows):
                    try:
                        self._emit(r, r.choose(logits[b]))
                    except Exception as e:
                        self._fail(r, e)
        self.running = [r for r in self.running if r.state != "done"]

    def _decode(self, rows: list[BatchReply]) -> torch.Tensor:
        """The rows' step (one ggml graph when the model and pool take it, else ``decode_rows``),
        on the CPU on the thread count its batch size's governor picks."""
        graphs = self._graphs()

        def call():
            tokens, seqs = [r.pending for r in rows], [r.seq for r in rows]
            if graphs is not None:
                return graphs.decode(tokens, seqs)
            return decode_rows(self.model.decoder, tokens, seqs)

        base = getattr(self.model, "decode_threads", None)
        if base is None or not getattr(self.model, "_governed", False):
            return call()
        gov = self._governors.get(len(rows))
        if gov is None:
            gov = self._governors[len(rows)] = ThreadGovernor(base.options, torch.set_num_threads, torch.get_num_threads)
        return gov.run(call, units=len(rows))

    def prepare(self) -> None:
        """Build what the decode steps need before the first reply (the batched graphs of every
        size up to ``max_batch``), so no reply's first token waits for it."""
        self._graphs()

    def _graphs(self) -> BatchGraphs | None:
        """The batched ggml graphs of this model and pool (None, said once in the log, when
        they do not take them, or ``decode_mode`` is not ggml: the rows then run eagerly)."""
        if self._ggml is None:
            why = "the decode mode is not ggml" if getattr(self.model, "decode_mode", None) != "ggml" else \
                ggml_unsupported(self.model.decoder, self.pool)
            if why:
                log.info("batched rows decode eagerly: %s", why)
                self._ggml = False
            else:  # every batch size's graph now (~20-40 ms each), not in the middle of a reply
                self._ggml = BatchGraphs(self.model.decoder, self.pool)
                self._ggml.prepare(self.max_batch)
        return self._ggml or None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            reply = self.waiting[0]
            if self.pool.limit_bytes is not None:
                held = sum(self.pool.bytes_for(r.request.most_tokens) for r in self.running)
                if held + self.pool.bytes_for(reply.request.most_tokens) > self.pool.limit_bytes:
                    return
            self.running.append(self.waiting.popleft())

    def _donor(self, reply: BatchReply) -> PagedSequence | None:
        """The live or kept sequence of the same salt sharing the longest prefix with ``reply``'s prompt."""
        prompt, best, best_n = reply.request.prompt, None, 0
        for seq in [r.seq for r in self.running if r is not reply] + self.donors:
            if seq.salt != reply.seq.salt or not seq.tokens:
                continue
            n = 0
            for x, y in zip(seq.tokens, prompt):
                if x != y:
                    break
                n += 1
            if n > best_n:
                best, best_n = seq, n
        return best

    def _fail(self, reply: BatchReply, error: Exception) -> None:
        reply.fail()
        if self.on_failed is not None:
            self.on_failed(reply, error)
        else:
            raise error

    def _emit(self, reply: BatchReply, events: list[Event]) -> None:
        if events and self.on_events is not None:
            self.on_events(reply, events)

    def run(self) -> None:
        """Step until every reply has ended (for callers that do not interleave)."""
        while self.busy:
            self.step()
