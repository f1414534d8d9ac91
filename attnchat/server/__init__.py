"""An OpenAI-compatible HTTP API over the engine: ``/v1/models``, ``/v1/chat/completions``
and ``/v1/completions``.

FastAPI on uvicorn. The event loop never runs the model: each request becomes a
:class:`attnchat.serve_engine.Job` for the engine's single worker thread, whose replies
come back through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue`` per request.
Streamed replies are server-sent events in OpenAI's ``chat.completion.chunk`` format.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status OpenAI would use (:mod:`.errors`). Must not import Qt.

Modules, by feature: :mod:`.app` (:func:`create_app`, the app and its small routes),
:mod:`.routes` (the two generation routes), :mod:`.request` (reading and checking a
request), :mod:`.relay` (the engine to the client, whole or streamed), :mod:`.chunks`
(the reply's JSON and event chunks), :mod:`.errors`.
"""
from attnchat.server.app import create_app
from attnchat.server.chunks import FINISH_REASONS
from attnchat.server.errors import APIError, overflow_error
from attnchat.server.relay import DISCONNECT_POLL_S, RETRY_AFTER_S
from attnchat.server.request import BODY_TIMEOUT_S, DRAIN_BYTES, MAX_BODY_BYTES, MAX_STOP, ROLES, ChatRequest

__all__ = ["APIError", "BODY_TIMEOUT_S", "ChatRequest", "DISCONNECT_POLL_S", "DRAIN_BYTES", "FINISH_REASONS",
           "MAX_BODY_BYTES", "MAX_STOP", "RETRY_AFTER_S", "ROLES", "create_app", "overflow_error"]
