"""The server's batching engine: one worker thread decodes several requests in each step.

No HTTP, no asyncio and no Qt here. :class:`BatchEngine` takes the same :class:`Job` and gives
the same items as :class:`attnchat.server.engine.Engine` (its base: the queue, cancel, the
counters and history are the same), but its worker runs a
:class:`runtime.generate.batch.Batcher` over one :class:`runtime.cache.paged.PagePool`: up to
``parallel`` replies decode in one decoder call per step (continuous batching), a new request
joins after its prompt is read in chunks, a finished one leaves, and a cancelled stream gives
its pages back at once. Each reply keeps its own sampling, stop strings, logits processors
(grammar, penalties, logprobs) and limits.

Prefix reuse is by pages, under the rule of :mod:`attnchat.server.reuse`: a request may take
pages up to the end of an earlier whole prompt of its partition that it extends, plus the part
of that reply it repeats, never a partial earlier prompt (which would let a client read another's
prompt by its cached tokens). Within that limit it shares the pages of a running request
(copy-on-write), of one of the last finished ones (their sequences are kept, pages held, until
the pool needs the room), or the pool's cached full pages. The partition is the salt of the
pages' keys: clients with different API keys never share a page.

The memory limit is the pool's: ``pool_bytes``, or the settings' cache limit when lower. A
request is admitted when the pool holds the worst case of every running one (prompt plus its
``max_tokens``), so a running reply never finds the pool full; the others wait in the queue,
which holds ``max_queued`` (:data:`MAX_QUEUED`: a waiting request holds only its body).

The overflow policy is ``stop`` (a conversation that does not fit is refused, as OpenAI does);
the other policies and the cache policies run on the one-at-a-time engine.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import replace
from typing import Any

from attnchat.server.engine import POOL_BYTES, POOL_IDLE_S, Engine
from attnchat.server.jobs import Delta, Done, Failed, Job, Started
from attnchat.server.reuse import TURNS
from runtime import ChatTemplateError, ContextOverflowError, GenerationSettings, Message, Model, ModelFileChanged
from runtime.cache.paged import PagePool
from runtime.device import trim_heap
from runtime.dtypes import parse_cache_dtype
from runtime.generate.batch import Batcher, BatchReply, ReplyRequest
from runtime.generate.events import Finish, PrefillProgress, TextPiece

log = logging.getLogger("attnchat.serve")

#: Replies decoding together by default (``attnchat serve --parallel``).
PARALLEL = 4
#: Requests that may wait for a place in the batch; more get 429. Each holds its body (at most
#: 1 MiB) until it runs: 64 of them at most 64 MiB.
MAX_QUEUED = 64
#: Replies whose token ids are remembered by their text (a reply the client sends back).
WRITTEN = 256


class BatchEngine(Engine):
    """A worker thread, a queue of :class:`Job` and a batch of replies over one page pool.

    Args:
        model: the loaded model (used only on the worker thread once started).
        settings: context, cache dtype, cache limit and prefill chunk; overflow ``stop``.
        parallel: the most replies decoding together (at least 1).
        max_queued: requests that may wait; more are refused (:class:`QueueFullError`).
        pool_bytes: the KV pool's byte limit (the settings' ``cache_limit_bytes`` when lower).
        pool_idle_s: seconds without a request after which the pool's memory is freed (0/None: never).
        on_reply: called on the worker thread with (finish reason, stats) of each reply.
        page_tokens: tokens per page.

    Raises:
        ValueError: ``parallel`` below 1, an overflow policy other than ``stop``, a cache
            policy, a context past the model's maximum.
    """

    def __init__(self, model: Model, *, settings: GenerationSettings | None = None, parallel: int = PARALLEL,
                 max_queued: int = MAX_QUEUED, pool_bytes: int = POOL_BYTES, pool_idle_s: float | None = POOL_IDLE_S,
                 on_reply=None, page_tokens: int = 16):
        settings = settings or GenerationSettings(overflow="stop")
        if parallel < 1:
            raise ValueError(f"the server needs at least 1 parallel reply; got {parallel}")
        if settings.overflow != "stop" or settings.cache_policy != "none":
            raise ValueError("parallel replies need --overflow stop and no cache policy; "
                             "use --parallel 1 for truncate-middle, rolling or a cache policy")
        super().__init__(model, settings=settings, sessions=1, max_queued=max_queued, pool_bytes=pool_bytes,
                         pool_idle_s=pool_idle_s, on_reply=on_reply)
        c = model.config
        limit = min(pool_bytes, settings.cache_limit_bytes or pool_bytes)
        dtype = parse_cache_dtype(settings.cache_dtype) if settings.cache_dtype else model.compute_dtype
        self.pool = PagePool(c.n_layers, c.n_kv_heads, c.head_dim, page_tokens=page_tokens, dtype=dtype,
                             device=model.device, windows=c.windows, limit_bytes=limit)
        self.parallel = parallel
        self.batcher = Batcher(model, self.pool, max_batch=parallel, prefill_chunk=settings.prefill_chunk,
                               on_events=self._on_events, on_failed=self._on_failed)
        self._jobs_of: dict[int, Job] = {}  # id(reply) -> its job
        # Finished replies' sequences, pages held, oldest first: the next turn of a conversation
        # shares them (prompt and reply, partial pages too); given back when the pool needs room.
        self._kept: collections.deque = collections.deque()
        self.keep = max(4, parallel)
        # (partition, reply text) -> the ids the model wrote for it: a reply sent back as written
        # keeps its ids (not re-tokenized), as the one-at-a-time engine's sessions do.
        self._written: collections.OrderedDict = collections.OrderedDict()
        self.pool.reclaim = self._reclaim
        # Per partition, the latest replies' [prompt ids, ids written] (the reuse rule's turns).
        self._turns: dict[str, collections.deque] = {}
        self._pages: dict[str, Any] = self.pool.stats()  # the pool's figures after the last step

    # ---- figures -----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """The pool's bytes: ``kv_used_bytes`` (pages in use), ``kv_allocated_bytes`` (arenas)."""
        pages = self._pages
        return {"kv_used_bytes": pages["used_bytes"], "kv_allocated_bytes": pages["allocated_bytes"]}

    def stats(self) -> dict[str, Any]:
        """The base engine's figures, with ``busy`` meaning a reply runs, ``running`` (replies
        in the batch), ``parallel`` and ``pages`` (the pool's page counts after the last step)."""
        out = super().stats()
        with self._lock:
            running = len(self._jobs_of)
        out.update(busy=running > 0, running=running, parallel=self.parallel, pages=dict(self._pages),
                   decode_steps=self.batcher.steps, decoded_rows=self.batcher.rows_decoded)
        return out

    # ---- the worker --------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self.batcher.busy:
                    # With pages allocated, wait at most the idle time; then free them (once).
                    timeout = self.pool_idle_s if self.pool.allocated_bytes else None
                    if not self._wake.wait(timeout) and not self._jobs:
                        self._release_pool()
                taken = []
                # Only as many as the batch has room for leave the queue: the rest keep their
                # place (and count against max_queued).
                while self._jobs and (self._jobs[0] is None or
                                      len(self.batcher.running) + len(self.batcher.waiting) + len(taken) < self.parallel):
                    taken.append(self._jobs.popleft())
            for job in taken:
                if job is None:
                    self._stop_all()
                    return
                self._take(job)
            for reply in list(self.batcher.running) + list(self.batcher.waiting):
                job = self._jobs_of.get(id(reply))
                if job is not None and job.cancelled.is_set():
                    self.batcher.cancel(reply)  # its pages go back now
            if self.batcher.busy:
                try:
                    self.batcher.step()
                except Exception:  # a bug outside any one reply: fail them all, keep serving
                    log.exception("a batched step failed")
                    for reply in list(self.batcher.running) + list(self.batcher.waiting):
                        self.batcher.cancel(reply)
                self._pages = self.pool.stats()
                if not self.batcher.busy:
                    if self.model.device.type == "cpu":
                        trim_heap()  # a prefill's freed activations back to the OS

    def _take(self, job: Job) -> None:
        """Turn a job into a queued reply (its prompt rendered here), or answer it now."""
        if job.cancelled.is_set():
            self._finish_unrun(job)
            return
        request = None
        try:
            request = self._request(job)
            reply = self.batcher.add(request)
        except (ContextOverflowError, ModelFileChanged, ChatTemplateError) as e:
            self._count("failed")
            self._send(job, Failed(e))
            return
        except ValueError as e:  # its worst case is more than the whole pool
            self._count("failed")
            n = len(request.prompt) if request is not None else 0
            self._send(job, Failed(ContextOverflowError(str(e), prompt_tokens=n, context_limit=self.context_limit)))
            return
        except Exception as e:  # a bug: report it to the client, keep serving
            log.exception("request %s failed", job.id)
            self._count("failed")
            self._send(job, Failed(e))
            return
        reply.keep_pages = True
        with self._lock:
            self._jobs_of[id(reply)] = job

    def _request(self, job: Job) -> ReplyRequest:
        """The job's prompt ids through the chat template (the pooled session renders them).

        Raises:
            ContextOverflowError: the prompt fills the context (the ``stop`` policy).
            ModelFileChanged, ChatTemplateError: as a session's reply.
        """
        self.model.check_file()
        session = self._pool[0]
        session.settings = replace(self.settings, tools=job.tools)
        session.system_prompt = job.system
        session.messages = [Message(m.role, m.content, self._written.get((job.partition, m.content)))
                            if m.role == "assistant" and m.token_ids is None else m for m in job.messages]
        ids = session.prompt_ids()
        if not ids:
            raise ChatTemplateError("the model's chat template and tokenizer turned this conversation into no "
                                    "tokens; pick another model or fix its template")
        limit = self.context_limit
        if len(ids) >= limit:
            raise ContextOverflowError(f"the conversation needs {len(ids)} tokens but the context holds {limit}; "
                                       "shorten the messages", prompt_tokens=len(ids), context_limit=limit)
        if job.prompt_logprobs is not None:
            from runtime.generate.scoring import token_logprobs

            job.prompt_entries = (ids, token_logprobs(self.model, ids, job.prompt_logprobs))
        turns = self._turns.setdefault(job.partition, collections.deque(maxlen=TURNS))
        share = max((_common(ids, written) for prompt, written in turns
                     if len(prompt) <= len(ids) and ids[: len(prompt)] == prompt), default=0)
        turns.append([list(ids), list(ids)])  # the reply's ids are added when it ends
        return ReplyRequest(tuple(ids), sampling=job.sampling, max_new_tokens=job.max_tokens, stop_strings=job.stop,
                            logits_processors=job.logits_processors, context_limit=limit, salt=job.partition,
                            share_limit=share)

    def _on_events(self, reply: BatchReply, events: list) -> None:
        job = self._jobs_of.get(id(reply))
        if job is None:
            return
        for ev in events:
            if isinstance(ev, PrefillProgress) and ev.done == 0:
                self._send(job, Started(ev.total))
            elif isinstance(ev, TextPiece):
                self._send(job, Delta(ev.text))
            elif isinstance(ev, Finish):
                for turn in self._turns.get(job.partition, ()):
                    if turn[0] == list(reply.request.prompt) and len(turn[1]) == len(turn[0]):
                        turn[1] = turn[0] + list(ev.token_ids)
                        break
                self._remember(job.partition, ev)
                if ev.reason != "cancelled" and reply.seq.length:
                    self._kept.append(reply.seq)
                    while len(self._kept) > self.keep:
                        self._reclaim()
                    self.batcher.donors = list(self._kept)
                with self._lock:  # not running before the client hears, so stats never lag
                    self._jobs_of.pop(id(reply), None)
                    self._pages = self.pool.stats()  # its pages are back (or kept)
                self._record(job, ev.reason, ev.stats)
                self._send(job, Done(ev.reason, ev.text, ev.stats, ev.token_ids))

    def _on_failed(self, reply: BatchReply, error: Exception) -> None:
        with self._lock:
            job = self._jobs_of.pop(id(reply), None)
        if job is not None:
            log.error("request %s failed: %r", job.id, error)
            self._count("failed")
            self._send(job, Failed(error))

    def _stop_all(self) -> None:
        for reply in list(self.batcher.running) + list(self.batcher.waiting):
            self.batcher.cancel(reply)

    def _remember(self, partition: str, ev: Finish) -> None:
        """Keep the ids of a reply's text (without the last ones when they only held bytes of a
        character the reply was cut inside; none after a stop string cut it): the session's rule."""
        if not ev.token_ids or not ev.text:
            return
        ids = list(ev.token_ids)
        decoded = self.model.tokenizer.decode(ids, skip_special_tokens=True)
        written = self._pool[0]._written_ids(ids, ev.text, decoded)
        if written is not None:
            self._written[(partition, ev.text)] = written
            while len(self._written) > WRITTEN:
                self._written.popitem(last=False)

    def _reclaim(self) -> bool:
        """Give back the oldest kept sequence's pages; False when none is kept."""
        if not self._kept:
            return False
        self._kept.popleft().release()
        self.batcher.donors = list(self._kept)
        return True

    def _release_pool(self) -> None:
        """Free the pool's arenas after an idle spell (the kept sequences first)."""
        while self._reclaim():
            pass
        if self.pool.release_arenas():
            self._pages = self.pool.stats()
            if self.model.device.type == "cpu":
                trim_heap()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
