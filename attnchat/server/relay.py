"""The glue between a request and the engine: submit a :class:`attnchat.server.engine.Job`,
carry its items from the engine's thread into an ``asyncio.Queue``, and answer with the
whole reply or a stream of server-sent events; a client that leaves cancels its job.
Must not import Qt.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from attnchat.server.chunks import SHUTDOWN
from attnchat.server.engine import (
    Delta,
    Done,
    Engine,
    Failed,
    Item,
    Job,
    QueueFullError,
    Started,
)
from attnchat.server.errors import APIError, failure

log = logging.getLogger("attnchat.serve")

#: How often a waiting request checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.25
#: What a 429 (the queue is full) suggests waiting before trying again (seconds).
RETRY_AFTER_S = 5


async def answer(engine: Engine, request: Request, job: Job, stream: bool,
                 streamer: Callable[[asyncio.Queue], AsyncIterator[str]],
                 whole: Callable[[Done], dict[str, Any]]) -> Response:
    """Run ``job`` on ``engine``; its reply as server-sent events from ``streamer`` or
    as the JSON object ``whole`` makes of the :class:`Done` item."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[Item | None] = asyncio.Queue()
    job.emit = lambda item: loop.call_soon_threadsafe(items.put_nowait, item)
    try:
        engine.submit(job)
    except QueueFullError:
        raise APIError(429, f"The server is busy: {engine.max_queued} requests are waiting already. "
                            f"Try again in {RETRY_AFTER_S} seconds.", type="server_error",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    # Until the reply streams (Starlette then watches the connection itself), a task
    # watches for the client leaving: it cancels the job and wakes this handler.
    watcher = asyncio.create_task(_watch_disconnect(request, engine, job, items))
    try:
        item = await items.get()
        if item is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if not isinstance(item, Started):
            return failure(item)
        if stream:
            watcher.cancel()
            return StreamingResponse(streamer(items), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        while not isinstance(item, (Done, Failed)):
            item = await items.get()
            if item is None:
                return Response(status_code=499)
    finally:
        watcher.cancel()
    if isinstance(item, Done) and item.reason == "cancelled" and engine.closing:
        item = replace(item, reason=SHUTDOWN)  # begun, then cut by the server stopping: what it wrote
    if isinstance(item, Failed) or item.reason == "cancelled":
        return failure(item)
    return JSONResponse(whole(item))


async def _watch_disconnect(request: Request, engine: Engine, job: Job, items: asyncio.Queue) -> None:
    """Cancel ``job`` and put ``None`` in ``items`` once the client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    engine.cancel(job)
    items.put_nowait(None)


async def stream_reply(items: asyncio.Queue, engine: Engine, job: Job, chunks: Any,
                       include_usage: bool) -> AsyncIterator[str]:
    """The reply as server-sent events (``chunks`` shapes them: a
    :class:`attnchat.server.chunks.ChatChunks` or ``CompletionChunks``); Starlette
    cancels this generator when the client leaves."""
    finished = False
    try:
        first = chunks.first()
        if first:
            yield first
        while not finished:
            batch = [await items.get()]
            while not items.empty():  # send what piled up as one chunk
                batch.append(items.get_nowait())
            if None in batch:  # the client left before the stream began
                return
            text = "".join(i.text for i in batch if isinstance(i, Delta))
            if text:
                out = chunks.text(text)
                if out:
                    yield out
            end = next((i for i in batch if isinstance(i, (Done, Failed))), None)
            if end is None:
                continue
            finished = True
            if isinstance(end, Done) and end.reason == "cancelled" and engine.closing:
                # the server is stopping (Ctrl-C): the reply so far ends as a reply cut short,
                # with its finish chunk and [DONE], not a broken stream
                end = replace(end, reason=SHUTDOWN)
            elif isinstance(end, Failed) or end.reason == "cancelled":
                body = failure(end).body
                yield f"data: {body.decode()}\n\n"
                return
            yield chunks.end(end)
            if include_usage:
                yield chunks.usage(end)
            yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected (or the server is stopping)
            log.info("client left during %s; cancelling it", job.id)
            engine.cancel(job)
