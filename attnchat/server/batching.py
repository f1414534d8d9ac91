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
from dataclasses import dataclass, replace
from typing import Any

from attnchat.server.engine import POOL_BYTES, POOL_IDLE_S, Engine
from attnchat.server.jobs import Delta, Done, Failed, Job, Started
from attnchat.server.reuse import TURNS
from runtime import ChatTemplateError, ContextOverflowError, GenerationSettings, Message, Model, ModelFileChanged
from runtime.cache.paged import PagePool
from runtime.device import free_memory_bytes, trim_heap
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
#: Bytes kept free beside the pool when :func:`plan` asks whether memory holds it: a prefill
#: chunk's activations, the replies' logits and the HTTP side.
RESERVE_BYTES = 512 << 20
#: What one waiting request may hold (its body of at most 1 MiB, the parsed messages, the
#: rendered prompt): :func:`plan` sizes the queue from the memory left at this much each.
QUEUED_BYTES = 4 << 20
#: The most requests :func:`plan` lets wait, however much memory is free.
MAX_QUEUED_AUTO = 1024


@dataclass(frozen=True)
class Plan:
    """How ``attnchat serve`` runs requests (:func:`plan`): ``parallel`` replies decoding
    together (1: the one-at-a-time engine), the KV pool's ``pool_bytes``, ``max_queued`` (None:
    the engine's default) and ``reason``, one line for the startup log."""

    parallel: int
    pool_bytes: int
    max_queued: int | None
    reason: str


def plan(model: Model, settings: GenerationSettings, *, parallel: int | None = None, pool_bytes: int | None = None,
         max_queued: int | None = None, free_bytes: int | None = -1) -> Plan:
    """Batching when it can work, else one request at a time, and why (``serve --parallel auto``).

    ``parallel`` None (auto) gives :data:`PARALLEL` when the overflow policy is ``stop``, no
    cache policy is set, the pool holds one whole conversation of the context and ``free_bytes``
    hold the pool plus :data:`RESERVE_BYTES`; else 1 and the reason. ``pool_bytes`` None gives
    batching the larger of :data:`POOL_BYTES` and one whole conversation (what the one-at-a-time
    engine's session takes for it), the one-at-a-time engine :data:`POOL_BYTES` of idle caches. With batching and ``max_queued`` None, the queue holds what
    the memory left after the pool allows at :data:`QUEUED_BYTES` a request, from
    :data:`MAX_QUEUED` to :data:`MAX_QUEUED_AUTO`.

    Args:
        model: the loaded model (its shape, device and compute dtype).
        settings: the server's settings (context, cache dtype, overflow, cache policy).
        parallel: replies decoding together as asked (None: auto).
        pool_bytes: the KV pool's bytes as asked (None: as above).
        max_queued: requests that may wait as asked (None: as above).
        free_bytes: free memory on the model's device in bytes (None: unknown, taken as
            enough; the default -1 asks :func:`runtime.device.free_memory_bytes`).

    Raises:
        ValueError: an asked ``parallel`` above 1 that cannot work (an overflow or cache
            policy, or memory that does not hold the pool): one line saying what to change.
    """
    if free_bytes == -1:
        free_bytes = free_memory_bytes(model.device)
    context = settings.context_limit or model.config.max_position_embeddings
    whole = _page_pool(model, settings, None).bytes_for(context)
    pool = max(POOL_BYTES, whole) if pool_bytes is None else pool_bytes
    pool = min(pool, settings.cache_limit_bytes or pool)
    mib = pool >> 20
    why_not = None
    if settings.overflow != "stop":
        why_not = f"batching needs --overflow stop, not --overflow {settings.overflow}"
    elif settings.cache_policy != "none":
        why_not = f"batching takes no cache policy (--cache-policy {settings.cache_policy})"
    elif free_bytes is not None and free_bytes < pool + RESERVE_BYTES:
        why_not = (f"{free_bytes >> 20} MiB free does not hold a {mib} MiB KV pool and {RESERVE_BYTES >> 20} MiB "
                   "beside it; lower --pool-mib or --context")
    elif pool < whole and parallel is None:
        why_not = (f"a {mib} MiB KV pool holds less than one {context}-token conversation ({whole >> 20} MiB); "
                   "raise --pool-mib or lower --context")
    if parallel is not None and parallel > 1 and why_not is not None:
        raise ValueError(f"--parallel {parallel}: {why_not}; or drop --parallel")
    if parallel == 1 or why_not is not None:
        return Plan(1, POOL_BYTES if pool_bytes is None else pool_bytes, max_queued,
                    "one request at a time: " + (why_not or "--parallel 1"))
    n = parallel or PARALLEL
    if max_queued is None:
        spare = None if free_bytes is None else free_bytes - pool - RESERVE_BYTES
        max_queued = MAX_QUEUED if spare is None else max(MAX_QUEUED, min(MAX_QUEUED_AUTO, spare // QUEUED_BYTES))
    k = pool // whole
    return Plan(n, pool, max_queued, f"{n} replies decode together (continuous batching over a {mib} MiB paged "
                                     f"KV cache: room for {k} whole {context}-token conversation{'s' * (k != 1)}); "
                                     f"{max_queued} requests may wait")


def _page_pool(model: Model, settings: GenerationSettings, limit: int | None, page_tokens: int = 16) -> PagePool:
    """The model's page pool in the settings' cache dtype (no arena until a page is taken)."""
    c = model.config
    dtype = parse_cache_dtype(settings.cache_dtype) if settings.cache_dtype else (getattr(model, "cache_dtype", None) or model.compute_dtype)
    return PagePool(c.n_layers, c.n_kv_heads, c.head_dim, page_tokens=page_tokens, dtype=dtype,
                    device=model.device, windows=c.windows, limit_bytes=limit)


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
        limit = min(pool_bytes, settings.cache_limit_bytes or pool_bytes)
        self.pool = _page_pool(model, settings, limit, page_tokens)
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
        self._sequences: list[dict] = []  # per running or kept sequence its pages, after the last step

    # ---- figures -----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """The pool's bytes: ``kv_used_bytes`` (pages in use), ``kv_allocated_bytes`` (arenas)."""
        pages = self._pages
        return {"kv_used_bytes": pages["used_bytes"], "kv_allocated_bytes": pages["allocated_bytes"]}

    def stats(self) -> dict[str, Any]:
        """The base engine's figures, with ``busy`` meaning a reply runs, ``running`` (replies
        in the batch), ``parallel``, ``pages`` (the pool's page counts after the last step) and
        ``sequences``: per running request (``id``, ``client``) or finished one kept for its next
        turn (``kept`` true) its ``tokens``, ``pages`` and ``shared_pages``, after the last step."""
        out = super().stats()
        with self._lock:
            running = len(self._jobs_of)
            sequences = [dict(s) for s in self._sequences]
        out.update(busy=running > 0, running=running, parallel=self.parallel, pages=dict(self._pages),
                   sequences=sequences, decode_steps=self.batcher.steps, decoded_rows=self.batcher.rows_decoded)
        return out

    def _figures(self) -> None:
        """The pool's and each sequence's page counts now (on the worker, which owns the pool)."""
        pages = self.pool.stats()
        rows = []
        for reply in list(self.batcher.running):
            job = self._jobs_of.get(id(reply))
            if job is not None:
                rows.append({"id": job.id, "client": job.client, "kept": False, **_pages_of(reply.seq)})
        rows += [{"id": None, "client": None, "kept": True, **_pages_of(seq)} for seq in self._kept]
        with self._lock:
            self._pages, self._sequences = pages, rows

    # ---- the worker --------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self.batcher.prepare()  # the batched graphs, before any request waits for them
        except Exception:  # the rows then decode as the first step decides
            log.exception("preparing the batched decode failed")
        while True:
            with self._lock:
                idle = False
                while not self._jobs and not self.batcher.busy and not idle:
                    # With pages allocated, wait at most the idle time; then free them (once).
                    timeout = self.pool_idle_s if self.pool.allocated_bytes else None
                    idle = not self._wake.wait(timeout) and not self._jobs
                taken = []
                # Only as many as the batch has room for leave the queue: the rest keep their
                # place (and count against max_queued).
                while self._jobs and (self._jobs[0] is None or
                                      len(self.batcher.running) + len(self.batcher.waiting) + len(taken) < self.parallel):
                    taken.append(self._jobs.popleft())
            if idle:  # outside the lock: freeing updates the figures, which take it
                self._release_pool()
                continue
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
                self._figures()
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
            # a 400 for this conversation is refused, as a full queue's 429 is; a changed file failed
            self._count("failed" if isinstance(e, ModelFileChanged) else "refused")
            self._send(job, Failed(e))
            return
        except ValueError as e:  # its worst case is more than the whole pool: a 400 too
            self._count("refused")
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
                self._figures()  # its pages are back (or kept)
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
            self._figures()
            if self.model.device.type == "cpu":
                trim_heap()


def _pages_of(seq) -> dict[str, int]:
    s = seq.stats()
    return {"tokens": s["tokens"], "pages": s["pages"], "shared_pages": s["shared_pages"]}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
