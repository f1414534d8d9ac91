"""An OpenAI-compatible HTTP API over the engine: ``/v1/models``, ``/v1/chat/completions``
and ``/v1/completions``.

FastAPI on uvicorn. The event loop never runs the model: each request becomes a
:class:`attnchat.server.engine.Job` for the engine's single worker thread, whose replies
come back through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue`` per request.
Streamed replies are server-sent events in OpenAI's ``chat.completion.chunk`` format.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status OpenAI would use (:mod:`.errors`). Must not import Qt.

Modules, by feature: :mod:`.app` (:func:`create_app`, the app and its small routes),
:mod:`.routes` (the two generation routes), :mod:`.request` (reading and checking a
request), :mod:`.relay` (the engine to the client, whole or streamed), :mod:`.chunks`
(the reply's JSON and event chunks), :mod:`.errors`.

Also here: the engine its requests run on (:mod:`.engine`), the HTTP guard (:mod:`.guard`:
Host, Origin, content types, body and connection limits), tool calls (:mod:`.tools`),
``/v1/completions`` (:mod:`.completions`), ``/metrics`` (:mod:`.metrics`) and the ``attnchat
serve`` command (:mod:`.command`). Importing this package imports none of them (the command
line stays quick); import :func:`attnchat.server.app.create_app`.
"""
