"""Remote engines: chat through an OpenAI-compatible server (attnchat serve, vLLM, llama.cpp, Ollama).

:class:`RemoteEngineWorker` is the app's engine worker. It is an
:class:`desktop.worker.EngineWorker` (same signals, same slots, same thread, same
batching and Stop) whose loading connects to a server when the source is a URL, and
loads the model locally otherwise; a connected server's conversations run in
:class:`RemoteSession`, which looks like :class:`runtime.ChatSession` to the worker
(``send``, ``regenerate``, ``cancel``, runtime events out; an edit is a send after the
history before the edited message). So the
window needs no special case: it loads a source, and the source decides. Sources, the
connection and errors in words live in :mod:`desktop.remote.client`.

Each reply is one streamed chat completion (``stream_options.include_usage`` when the
server takes it). Stop closes the stream at the next chunk, which cancels the reply on
the server. Figures: the server's ``usage`` (and attnchat's own ``attnchat`` extension),
with the time to first token and tokens per second measured here. A remote engine
exposes no KV cache and no attention: its ``model_loaded`` dict and every stats dict
carry ``"remote": True``, and stats carry ``"server_usage"`` (see :data:`REMOTE_KV_NOTE`).

Imports runtime's public API only (no torch, no widgets); ``openai`` only when used.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import runtime
from desktop.remote.client import RemoteEngineError, RemoteModel, describe_error, is_remote_source, parse_remote_source
from desktop.remote.secrets import KeyStore
from desktop.worker import EngineWorker

__all__ = ["REMOTE_ATTENTION_NOTE", "REMOTE_KV_NOTE", "RemoteEngineWorker", "RemoteSession", "RemoteTurnStats",
           "usage_text"]

log = logging.getLogger(__name__)

#: OpenAI's finish reasons -> the session's.
FINISH_REASONS = {"stop": "stop", "length": "length", "content_filter": "stop", "tool_calls": "stop"}

REMOTE_KV_NOTE = ("The server keeps this model's KV cache, so there is no chart here. "
                  "Below is what the server reports for the last reply.")
REMOTE_ATTENTION_NOTE = ("A remote engine does not expose its attention: only the local engine can show "
                         "where each head looks. Open a model file to see it.")


@dataclass
class RemoteTurnStats(runtime.TurnStats):
    """A reply's figures from a server: :class:`runtime.TurnStats` plus what the server said.

    ``prompt_tokens``/``completion_tokens``/``reused_tokens`` are the server's ``usage``
    (``prompt_tokens_details.cached_tokens``); without usage (a stopped reply, or a server
    that does not send it) ``completion_tokens`` counts the text chunks. ``ttft_s`` and
    ``decode_tokens_per_s`` are measured here, network included.
    """

    server_usage: dict = field(default_factory=dict)   # the server's usage object, as sent
    server_stats: dict = field(default_factory=dict)   # attnchat's "attnchat" extension, if any

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["remote"] = True
        return d


class RemoteSession:
    """A conversation on a server, shaped like :class:`runtime.ChatSession` for the worker.

    The worker sets ``messages`` (the database's) before each call; ``send`` and
    ``regenerate`` return iterators of runtime events
    (:class:`runtime.TextPiece` ..., then one :class:`runtime.Finish`). :meth:`cancel`
    is thread-safe.
    """

    def __init__(self, model: RemoteModel, system_prompt: str | None, settings: "runtime.GenerationSettings"):
        self.model, self.system_prompt, self.settings = model, system_prompt, settings
        self.messages: list[runtime.Message] = []
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def send(self, text: str) -> Iterator["runtime.Event"]:
        self.messages.append(runtime.Message("user", text))
        return self._generate()

    def regenerate(self) -> Iterator["runtime.Event"]:
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        return self._generate()

    def _payload(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": m.role, "content": m.content} for m in self.messages]

    def _generate(self) -> Iterator["runtime.Event"]:
        import openai

        self._cancel.clear()
        base = self.model.base_url
        t0 = time.perf_counter()
        first = last = 0.0
        pieces: list[str] = []
        reason, usage, extension, ended = "stop", None, {}, False
        try:
            stream = self.model.open_stream(self._payload(), self.settings)
        except openai.OpenAIError as e:
            raise RemoteEngineError(describe_error(e, base, self.model.model_id)) from e
        try:
            chunks = iter(stream)
            while not self._cancel.is_set():  # checked again after each piece is handed over
                chunk = next(chunks, None)
                if chunk is None:
                    ended = True
                    break
                usage = chunk.usage or usage
                extension = (chunk.model_extra or {}).get("attnchat") or extension
                for choice in chunk.choices:
                    if choice.finish_reason:
                        reason = FINISH_REASONS.get(choice.finish_reason, "stop")
                    text = choice.delta.content if choice.delta is not None else None
                    if text:
                        last = time.perf_counter()
                        first = first or last
                        pieces.append(text)
                        yield runtime.TextPiece(text)
        except openai.OpenAIError as e:
            raise RemoteEngineError(describe_error(e, base, self.model.model_id)) from e
        finally:
            stream.close()  # before the end: the server sees the client leave and cancels
        if not ended:
            reason = "cancelled"
        text = "".join(pieces)
        if text:
            self.messages.append(runtime.Message("assistant", text))
        yield runtime.Finish(reason, text, self._stats(usage, extension, len(pieces), t0, first, last))

    def _stats(self, usage: Any, extension: dict, chunks: int, t0: float, first: float, last: float) -> RemoteTurnStats:
        prompt = completion = cached = 0
        if usage is not None:
            prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
            details = getattr(usage, "prompt_tokens_details", None)
            cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        else:
            completion = chunks
        return RemoteTurnStats(
            prompt_tokens=prompt, reused_tokens=cached, prefilled_tokens=max(prompt - cached, 0),
            completion_tokens=completion, ttft_s=(first - t0) if first else 0.0,
            decode_tokens_per_s=(completion - 1) / (last - first) if completion > 1 and last > first else 0.0,
            context_limit=self.model.context_limit,
            server_usage=usage.model_dump(exclude_none=True) if usage is not None else {},
            server_stats=dict(extension))


# ---- the worker -------------------------------------------------------------------------
class RemoteEngineWorker(EngineWorker):
    """The engine worker that can also chat through a server (see the module docstring).

    It overrides no slot (PySide6 would then call the override on the caller's thread):
    it only wraps the worker's load and session factories, so a URL source connects
    and its conversations run as :class:`RemoteSession`.

    Args:
        keys: where API keys are found (by base URL); default: the system keyring, else memory.
        load_fn, session_fn, batch_ms: as :class:`desktop.worker.EngineWorker`, for local sources.
    """

    def __init__(self, load_fn=None, session_fn=None, batch_ms: int = 30, *, keys: KeyStore | None = None):
        super().__init__(load_fn, session_fn, batch_ms)
        self.keys = keys if keys is not None else KeyStore()
        self._remote: RemoteModel | None = None
        local_load, local_session = self._load_fn, self._session_fn
        self._load_fn = lambda source, device: self._load(source, device, local_load)
        self._session_fn = lambda model, system, settings: (
            RemoteSession(model, system, settings) if isinstance(model, RemoteModel)
            else local_session(model, system, settings))

    def _load(self, source: str, device: str, local_load):
        """The engine thread: connect to a server source, or load a local one."""
        if self._remote is not None:  # the worker has dropped it already: close its connections
            self._remote.close()
            self._remote = None
        if not is_remote_source(source):
            return local_load(source, device)
        base_url, _ = parse_remote_source(source)  # ValueError: a bad address, shown as is
        self._remote = RemoteModel.connect(source, self.keys.get(base_url))
        return self._remote


# ---- for the panels -----------------------------------------------------------------------
def usage_text(stats: dict | None) -> str:
    """What a server reported for a reply, in one line (for the KV-cache panel of a remote engine)."""
    if not stats:
        return "No reply yet."
    u = stats.get("server_usage") or {}
    if not u:
        parts = [f"The server sent no token counts; about {stats.get('completion_tokens', 0):,} reply tokens."]
    else:
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        parts = [f"Server usage: {u.get('prompt_tokens', 0):,} prompt tokens"
                 + (f" ({cached:,} reused from its cache)" if cached else "")
                 + f", {u.get('completion_tokens', 0):,} reply tokens."]
    kv = (stats.get("server_stats") or {}).get("kv_cache") or {}
    if kv.get("used_bytes") is not None:   # an attnchat server sends its cache's figures
        held = f"{int(kv['tokens']):,} tokens, " if kv.get("tokens") is not None else ""
        alloc = f" ({kv['allocated_bytes'] / 2**20:,.2f} MiB allocated)" if kv.get("allocated_bytes") else ""
        parts.append(f"Its KV cache after the reply: {held}{kv['used_bytes'] / 2**20:,.2f} MiB used{alloc}"
                     + (f", {kv['dtype']}." if kv.get("dtype") else "."))
    timing = []
    if stats.get("ttft_s"):
        timing.append(f"first token after {stats['ttft_s']:.2f} s")
    if stats.get("decode_tokens_per_s"):
        timing.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    if timing:
        parts.append("Measured here: " + ", ".join(timing) + ".")
    return " ".join(parts)
