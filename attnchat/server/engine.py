"""The server's engine: one worker thread owns the model and runs requests one at a time.

No HTTP, no asyncio and no Qt here: the HTTP layer (``attnchat.server``) builds a
:class:`Job` with a thread-safe ``emit`` callback and submits it; the worker replies
with plain data (:class:`Started`, :class:`Delta`, :class:`Done`, :class:`Failed`).

Prefix reuse: the worker keeps a small pool of :class:`runtime.ChatSession` objects; a
request (a whole conversation) goes to the session of its API key's partition with the
longest earlier prompt it extends and reuses its cache as :mod:`attnchat.server.reuse` says.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from runtime import (
    ChatSession,
    ChatTemplateError,
    ContextOverflowError,
    Finish,
    GenerationSettings,
    Message,
    Model,
    ModelFileChanged,
    PrefillProgress,
    TextPiece,
    TurnStats,
)
from attnchat.server.jobs import Delta, Done, Failed, Item, Job, QueueFullError, Started  # noqa: F401 (re-exported)
from attnchat.server.reuse import Owner
from runtime.device import trim_heap
from runtime.generate.context import common_prefix_length

log = logging.getLogger("attnchat.serve")

#: Requests remembered for ``/v1/attnchat/stats``.
HISTORY = 16
#: Default KV-cache bytes the idle pooled sessions may keep (``attnchat serve --pool-mib``):
#: 256 MiB holds 11,648 tokens (728 pages) of the default model's float16 cache (23,040 bytes a
#: token; 5,824 in float32).
POOL_BYTES = 256 << 20

#: A reply whose prefill passed this many tokens left megabytes of freed activations in
#: the C heap: give them back to the OS after it (:func:`runtime.device.trim_heap`). Without
#: it one long request kept the server's RSS up for good (600 -> 1,169 MiB); after
#: a 2,000-token prompt on the default model it took 80 ms, RSS 646 -> 558 MiB (AMD EPYC
#: Zen 3, shared, loaded). It runs on the engine thread after the reply has been sent.
TRIM_AFTER_PREFILL = 256

#: Seconds without a request after which the pooled KV caches are freed and the heap trimmed
#: (``--pool-idle-s``; 0: never): they serve a client's next turn, which an API loop sends
#: within seconds; after a burst they held up to :data:`POOL_BYTES` (RSS 509 -> 779 MiB).
POOL_IDLE_S = 10.0

#: Requests that may wait behind the running one; more are refused (the server answers 429).
#: Each holds its whole conversation (up to the 1 MiB body limit) until it runs.
MAX_QUEUED = 16


class Engine:
    """A worker thread, a queue of :class:`Job` and a pool of sessions over one model.

    Args:
        model: the loaded model (used only on the worker thread once started).
        settings: the sessions' settings (context, cache dtype, overflow policy);
            each job's ``settings`` replace them for its reply.
        sessions: how many conversations keep their KV cache (at least 1).
        pool_bytes: KV-cache bytes the sessions may keep allocated between requests;
            after each reply the least recently used caches are freed (their
            conversations re-prefilled if they come back) until the pool fits.
        pool_idle_s: seconds without a request after which every pooled cache is freed
            (:data:`POOL_IDLE_S`; 0 or None: kept until the pool needs the room).
        on_reply: called on the worker thread with (finish reason, stats) of each reply.
    """

    def __init__(self, model: Model, *, settings: GenerationSettings | None = None, sessions: int = 4,
                 max_queued: int = MAX_QUEUED, pool_bytes: int = POOL_BYTES, pool_idle_s: float | None = POOL_IDLE_S,
                 on_reply: Callable[[str, TurnStats], None] | None = None):
        if sessions < 1:
            raise ValueError(f"the server needs at least 1 session; got {sessions}")
        self.model = model
        self.settings = settings or GenerationSettings()
        self.pool_size = sessions
        self.max_queued = max_queued
        self.pool_bytes = pool_bytes
        self.pool_idle_s = pool_idle_s if pool_idle_s and pool_idle_s > 0 else None
        self.on_reply = on_reply
        self._pool: list[ChatSession] = []  # most recently used last
        self._owners: dict[int, Owner] = {}  # id(session) -> whose it is, its turns
        # Waiting jobs (None: the stop sign). A deque, not a queue.Queue, so a cancelled
        # job leaves it at once instead of holding its conversation until its turn.
        self._jobs: collections.deque[Job | None] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._running: tuple[Job, ChatSession] | None = None
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.counts = collections.Counter()
        #: True once :meth:`close` began: the replies it ends were cut by the server stopping,
        #: which the HTTP side says with a finish chunk (not an error), and nothing new is taken.
        self.closing = False
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        # Built once (it validates the context against the model) so a bad setting fails
        # at start-up, not on the first request.
        self._pool.append(ChatSession(model, settings=self.settings))

    @property
    def context_limit(self) -> int:
        return self._pool[0].context_limit if self._pool else 0

    # ---- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.closing = False  # started again after a close (an app's lifespan run twice)
            self._thread = threading.Thread(target=self._work, name="attnchat-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running reply, drop queued ones and stop the worker."""
        with self._lock:
            self.closing = True
            dropped = [j for j in self._jobs if j is not None]
            self._jobs.clear()
        for job in dropped:
            job.cancelled.set()
            self._finish_unrun(job)
        with self._lock:
            if self._running is not None:
                self._running[0].cancelled.set()
                self._running[1].cancel()
            self._jobs.append(None)
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- requests --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; its items arrive through ``job.emit`` from the worker thread.

        Raises:
            QueueFullError: :attr:`max_queued` jobs wait already (the job is not queued).
        """
        if not self.closing:
            self.start()  # idempotent: the app's lifespan normally started it already
        if not job.id:
            job.id = f"job-{next(self._ids)}"
        with self._lock:
            closing = self.closing  # read under the lock close() drains the queue with
            if not closing:
                if len(self._jobs) >= self.max_queued:
                    self.counts["refused"] += 1
                    raise QueueFullError(f"{len(self._jobs)} requests are waiting already")
                self.counts["requests"] += 1
                self._jobs.append(job)
                self._wake.notify()
        if closing:  # the worker takes nothing more: answered now, as cancelled (a 503)
            self._finish_unrun(job)

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (thread-safe): dropped from the queue if waiting (its conversation
        freed now, its ``emit`` told "cancelled"), stopped within one step if running."""
        job.cancelled.set()
        with self._lock:
            if self._running is not None and self._running[0] is job:
                self._running[1].cancel()
                return
            try:
                self._jobs.remove(job)
            except ValueError:
                return  # finished, or taken by the worker (which sees the flag)
        self._finish_unrun(job)

    def stats(self) -> dict[str, Any]:
        """Counters, queue depth and the last requests (plain data for the stats endpoint).

        ``refused``: requests turned away, a full queue (429) or a conversation the model cannot
        take (longer than the context, refused by its chat template: 400); ``failed``: the
        server's own failures (a bug, the model file changed: 5xx)."""
        with self._lock:
            busy = self._running is not None
            queued = sum(1 for j in self._jobs if j is not None)
            counts = dict(self.counts)
            last = list(self.history)[::-1]
        return {
            "requests": counts.get("requests", 0),
            "finished": dict(sorted((k.removeprefix("finish_"), v) for k, v in counts.items()
                                    if k.startswith("finish_"))),
            "failed": counts.get("failed", 0),
            "refused": counts.get("refused", 0),
            "queued": queued,
            "busy": busy,
            "sessions": len(self._pool),
            **self.memory(),
            "last": last,
        }

    # ---- the worker ------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                idle = False
                while not self._jobs and not idle:
                    # With caches kept, wait at most the idle time; then free them (once).
                    timeout = self.pool_idle_s if self.memory()["kv_allocated_bytes"] else None
                    idle = not self._wake.wait(timeout) and not self._jobs
                job = None if idle else self._jobs.popleft()
            if idle:
                self._trim_pool(keep=0)
                continue
            if job is None:
                return
            if job.cancelled.is_set():
                self._finish_unrun(job)
                continue
            prefilled = 0
            try:
                prefilled = self._run(job)
            except ChatTemplateError as e:  # this conversation's: a 400, not the server failing
                log.info("request %s refused: %s", job.id, e)
                self._count("refused")
                self._send(job, Failed(e))
            except Exception as e:  # a bug: report it to the client, keep serving
                log.exception("request %s failed", job.id)
                self._count("failed")
                self._send(job, Failed(e))
            finally:
                with self._lock:
                    self._running = None
                self._trim_pool(prefilled)

    def _trim_pool(self, prefilled: int = 0, keep: int | None = None) -> int:
        """Give idle KV-cache memory back; returns the cache bytes freed.

        Every pooled session is idle here: each cache shrinks to the smallest chunk
        multiple that holds its tokens (a session reset for a short conversation, or
        cropped, no longer keeps a long one's buffers), then the least recently used
        caches are freed until the pool's allocated bytes fit ``keep`` (default
        :attr:`pool_bytes`; 0 once idle for :attr:`pool_idle_s`: a long request's cache is
        not kept for ever). On the CPU the freed buffers, and the
        activations of a prefill over :data:`TRIM_AFTER_PREFILL` tokens, are then handed
        back to the OS: glibc keeps freed memory in the process (RSS) otherwise.
        """
        freed = sum(s.cache.shrink_to_fit() for s in self._pool)
        total = sum(s.cache.allocated_bytes for s in self._pool)
        for s in self._pool:  # least recently used first
            if total <= (self.pool_bytes if keep is None else keep):
                break
            if s.cache.allocated_bytes:
                total -= s.cache.allocated_bytes
                freed += s.cache.allocated_bytes
                s.reset()
                s.cache.release()
                self._owner(s).turns = []
        if (freed or prefilled > TRIM_AFTER_PREFILL) and self.model.device.type == "cpu":
            trim_heap()
        return freed

    def memory(self) -> dict[str, int]:
        """KV-cache bytes of the pooled sessions: ``kv_used_bytes``, ``kv_allocated_bytes``."""
        pool = list(self._pool)
        return {"kv_used_bytes": sum(s.cache.used_bytes for s in pool),
                "kv_allocated_bytes": sum(s.cache.allocated_bytes for s in pool)}

    def _finish_unrun(self, job: Job) -> None:
        self._record(job, "cancelled", TurnStats())
        self._send(job, Done("cancelled", "", TurnStats()))

    def _owner(self, s: ChatSession) -> Owner:
        return self._owners.setdefault(id(s), Owner())

    def _session_for(self, job: Job) -> tuple[ChatSession, int | None]:
        """The pooled session of the job's partition (and tools: they are part of the prompt)
        with the longest earlier prompt the job's conversation extends, and how many of its
        cached tokens the job may reuse (the module's rule); else a fresh or the least
        recently used session, reset (nothing of its cache may answer someone else)."""
        want = job.conversation()
        best, best_turn = None, None
        for s in reversed(self._pool):  # most recently used first: it wins ties
            owner = self._owner(s)
            if owner.partition != job.partition or s.settings.tools != job.tools:
                continue
            have = [Message("system", s.system_prompt or "")] + s.messages
            n = common_prefix_length(have, want)
            turn = owner.longest_turn(n)
            if turn is not None and (best_turn is None or turn.messages > best_turn.messages):
                best, best_turn = s, turn
        if best is None:
            if len(self._pool) < self.pool_size:
                best = ChatSession(self.model, settings=self.settings)
            else:
                best = self._pool[0]
                best.reset()
            self._owners[id(best)] = Owner(job.partition)
        if best in self._pool:
            self._pool.remove(best)
        self._pool.append(best)
        return best, (0 if best_turn is None else best_turn.reuse_end)

    def _run(self, job: Job) -> int:
        """Answer ``job`` on a pooled session; returns the tokens it prefilled."""
        session, max_reuse = self._session_for(job)
        session.settings = replace(self.settings, sampling=job.sampling, max_new_tokens=job.max_tokens,
                                   stop_strings=job.stop, logits_processors=job.logits_processors,
                                   tools=job.tools)
        session.system_prompt = job.system
        # A reply the client sends back exactly as this session wrote it keeps the session's
        # token ids (Message equality is role and text), so it is not re-tokenized.
        mine = session.messages
        session.messages = [mine[i] if i < len(mine) and mine[i] == m else m for i, m in enumerate(job.messages)]
        if job.prompt_logprobs is not None:
            from runtime.generate.scoring import token_logprobs

            ids = session.prompt_ids()
            if len(ids) <= session.context_limit:  # else the reply is refused as too long
                job.prompt_entries = (ids, token_logprobs(self.model, ids, job.prompt_logprobs))
        with self._lock:
            self._running = (job, session)
            events = session.reply(max_reuse=max_reuse)  # clears the session's cancel flag ...
        if job.cancelled.is_set():  # ... so a cancel that came first is applied again
            session.cancel()
        started, prefilled = False, 0
        try:
            for ev in events:
                if job.cancelled.is_set():
                    session.cancel()
                if isinstance(ev, PrefillProgress) and not started:
                    started = True
                    self._send(job, Started(ev.total))
                elif isinstance(ev, TextPiece):
                    self._send(job, Delta(ev.text))
                elif isinstance(ev, Finish):
                    if not started and ev.reason == "context":
                        # The "stop" policy refuses a prompt that fills the context.
                        n, limit = ev.stats.prompt_tokens, session.context_limit
                        session.messages = list(job.messages)  # no empty reply left behind
                        raise ContextOverflowError(
                            f"the conversation needs {n} tokens but the context holds {limit}; "
                            "shorten the messages", prompt_tokens=n, context_limit=limit)
                    self._owner(session).note(ev.stats, len(job.conversation()), session.stream_length)
                    with self._lock:  # idle before the client hears, so stats never lag
                        self._running = None
                    self._record(job, ev.reason, ev.stats)
                    self._send(job, Done(ev.reason, ev.text, ev.stats, ev.token_ids))
                    prefilled = ev.stats.prefilled_tokens
        except (ContextOverflowError, ModelFileChanged) as e:  # the session and its cache are unchanged
            # too long for the context: refused (a 400), as a full queue's 429 is; not a failure
            self._count("refused" if isinstance(e, ContextOverflowError) else "failed")
            self._send(job, Failed(e))
        except Exception:
            session.reset()  # its cache may not match its token stream any more
            self._owners[id(session)] = Owner(job.partition)
            raise
        return prefilled

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _record(self, job: Job, reason: str, stats: TurnStats) -> None:
        self._count(f"finish_{reason}")
        if self.on_reply is not None:
            try:
                self.on_reply(reason, stats)
            except Exception:  # metrics must never break a reply
                log.exception("on_reply failed")
        entry = {
            "id": job.id, "finish_reason": reason, "time": time.time(), "client": job.client,
            "prompt_tokens": stats.prompt_tokens, "reused_tokens": stats.reused_tokens,
            "prefilled_tokens": stats.prefilled_tokens, "completion_tokens": stats.completion_tokens,
            "dropped_tokens": stats.dropped_tokens, "evicted_tokens": stats.evicted_tokens, "ttft_s": stats.ttft_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
        }
        with self._lock:
            self.history.append(entry)

    @staticmethod
    def _send(job: Job, item: Item) -> None:
        try:
            job.emit(item)
        except Exception:  # the client's loop is gone (shutdown): nobody to tell
            log.debug("dropped %r for %s", item, job.id, exc_info=True)

