"""The client side of a remote engine: server sources, errors in words, the model list, a connection.

A model source that is an ``http(s)://`` URL is a server: ``<base URL>#model=<id>``
(the fragment is never sent anywhere; it only names the model). The API key is not
part of the source: it lives in a :class:`desktop.remote.secrets.KeyStore`.
:class:`RemoteModel` is a connection to one model on a server, made and used on the
engine thread (:mod:`desktop.remote.engine` runs the conversations).

Imports runtime's public API only (no torch, no Qt); ``openai`` only when used.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

import runtime

__all__ = [
    "CONNECT_TIMEOUT_S", "READ_TIMEOUT_S", "RemoteEngineError", "RemoteModel", "describe_error",
    "is_remote_source", "list_models", "normalize_base_url", "parse_remote_source", "remote_source",
    "source_label",
]

log = logging.getLogger(__name__)

#: Seconds to open a connection: a server on this machine or the LAN answers far sooner.
CONNECT_TIMEOUT_S = 5.0
#: Seconds to wait for the next bytes of a reply (a busy server may queue a request).
READ_TIMEOUT_S = 300.0

class RemoteEngineError(runtime.AttnchatError):
    """A server could not be used; the message says what went wrong in words."""


# ---- sources ----------------------------------------------------------------------------
def is_remote_source(source: str) -> bool:
    """True when ``source`` names a server rather than a model file or folder."""
    return source.strip().lower().startswith(("http://", "https://"))


def normalize_base_url(text: str) -> str:
    """The API's base URL from what a user typed: ``127.0.0.1:8000`` -> ``http://127.0.0.1:8000/v1``.

    Adds ``http://`` when no scheme is given and ``/v1`` when no path is; drops a trailing
    ``/chat/completions`` or ``/models``.

    Raises:
        ValueError: not an http(s) address.
    """
    t = text.strip()
    if not t:
        raise ValueError("enter the server's address, such as http://127.0.0.1:8000/v1")
    if "://" not in t:
        t = "http://" + t
    try:
        u = urlsplit(t)
        u.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a valid address; use one such as http://127.0.0.1:8000/v1") from None
    if u.scheme.lower() not in ("http", "https") or not u.hostname:
        raise ValueError(f"{text.strip()!r} is not an http:// or https:// address")
    path = u.path.rstrip("/")
    for suffix in ("/chat/completions", "/models"):
        path = path.removesuffix(suffix)
    return urlunsplit((u.scheme.lower(), u.netloc, path or "/v1", "", ""))


def remote_source(base_url: str, model: str) -> str:
    """The source string for ``model`` on the server at ``base_url``."""
    return f"{normalize_base_url(base_url)}#model={quote(model, safe='')}"


def parse_remote_source(source: str) -> tuple[str, str]:
    """``(base_url, model)`` of a server source (``model`` is "" when not named).

    Raises:
        ValueError: not a server address.
    """
    url, _, fragment = source.strip().partition("#")
    return normalize_base_url(url), parse_qs(fragment).get("model", [""])[0]


def source_label(source: str) -> str:
    """A short name for a source, for "Loading …" and "Connecting to …"."""
    if not source:
        return "the default model"
    if is_remote_source(source):
        try:
            base_url, model = parse_remote_source(source)
        except ValueError:
            return source
        return f"{model or 'a model'} at {urlsplit(base_url).netloc}"
    return Path(source).name


# ---- errors in words --------------------------------------------------------------------
def _server_message(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    if isinstance(body, str) and body.strip():
        return body.strip()[:300]
    return getattr(e, "message", "") or str(e)


def _cause(e: BaseException) -> str:
    """The innermost reason of a connection error: "Connection refused", "Name or service not known"..."""
    seen, c = set(), e.__cause__ or e.__context__
    reason = ""
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        if isinstance(c, OSError) and c.strerror:
            return c.strerror
        reason = str(c) or reason
        c = c.__cause__ or c.__context__
    return reason


def describe_error(e: Exception, base_url: str, model: str = "") -> str:
    """One line for the user about an ``openai`` error: what went wrong and what to do."""
    import openai

    if isinstance(e, openai.APITimeoutError):
        return (f"the server at {base_url} did not answer in time; check that it is running "
                "and not busy, then try again")
    if isinstance(e, openai.APIConnectionError):
        why = _cause(e)
        return (f"could not reach the server at {base_url}{f' ({why})' if why else ''}; check the address "
                "and that the server is running")
    message = _server_message(e)
    if isinstance(e, (openai.AuthenticationError, openai.PermissionDeniedError)):
        return (f"the server at {base_url} refused the API key ({e.status_code}: {message}); enter the "
                "right key in File > Connect to server…")
    if isinstance(e, openai.NotFoundError):
        if model and (getattr(e, "code", None) == "model_not_found" or "model" in message.lower()):
            return (f"the server at {base_url} has no model '{model}' (404: {message}); pick one of its "
                    "models in File > Connect to server…")
        return (f"{base_url} does not answer like an OpenAI-compatible API (404: {message}); check the "
                "address (it usually ends in /v1)")
    if isinstance(e, openai.APIStatusError):
        return f"the server at {base_url} refused the request ({e.status_code}: {message})"
    if isinstance(e, openai.APIError):
        return f"the server at {base_url} stopped the reply: {message}"
    return f"the server at {base_url} could not be used ({type(e).__name__}: {e})"


# ---- the server -------------------------------------------------------------------------
def _client(base_url: str, key: str, read_timeout_s: float = READ_TIMEOUT_S):
    import openai

    # A server without keys ignores the header; "none" keeps the client from reading
    # OPENAI_API_KEY, a key meant for someone else's server.
    return openai.OpenAI(base_url=base_url, api_key=key or "none", max_retries=0,
                         timeout=openai.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S))


def _context_length(card: Any) -> int:
    extra = getattr(card, "model_extra", None) or {}
    for name in ("context_length", "max_model_len", "context_window"):  # attnchat, vLLM, others
        if isinstance(extra.get(name), int):
            return extra[name]
    return 0


def list_models(base_url: str, key: str = "", *, timeout_s: float = 15.0) -> list[dict]:
    """The server's models (``GET /models``) as ``[{"id", "context_length", "owned_by"}]``. Blocks.

    Raises:
        RemoteEngineError: the server could not be reached or refused (in words).
    """
    import openai

    try:
        with _client(base_url, key, timeout_s) as client:
            cards = list(client.models.list())
    except openai.OpenAIError as e:
        raise RemoteEngineError(describe_error(e, base_url)) from e
    return [{"id": c.id, "context_length": _context_length(c), "owned_by": getattr(c, "owned_by", "") or ""}
            for c in cards]


class RemoteModel:
    """A model on a server, connected: the worker's ``_model`` when the engine is remote.

    Made with :meth:`connect` on the worker thread; its client is used only there.
    """

    remote = True  # desktop.worker.model_info asks the model for its info()

    def __init__(self, base_url: str, model_id: str, key: str, context_limit: int, connect_seconds: float):
        self.base_url, self.model_id, self.context_limit = base_url, model_id, context_limit
        self.connect_seconds = connect_seconds
        self.usage_in_stream = True  # cleared when the server refuses stream_options
        self.client = _client(base_url, key)
        # What the worker reads of a local model's config: the context limit (None: unknown).
        self.config = SimpleNamespace(max_position_embeddings=context_limit or None)

    @classmethod
    def connect(cls, source: str, key: str) -> "RemoteModel":
        """Check the server answers and serves the model (``GET /models``); "" picks its first.

        Raises:
            RemoteEngineError: unreachable, a refused key, or no such model (in words).
        """
        t0 = time.perf_counter()
        try:
            base_url, model = parse_remote_source(source)
        except ValueError as e:
            raise RemoteEngineError(str(e)) from None
        models = list_models(base_url, key)
        if not models:
            raise RemoteEngineError(f"the server at {base_url} lists no models; load one there first")
        ids = [m["id"] for m in models]
        if not model:
            model = ids[0]
        elif model not in ids:
            shown = ", ".join(ids[:5]) + (" …" if len(ids) > 5 else "")
            raise RemoteEngineError(f"the server at {base_url} has no model '{model}' (it serves {shown}); "
                                    "pick one in File > Connect to server…")
        card = models[ids.index(model)]
        return cls(base_url, model, key, card["context_length"], time.perf_counter() - t0)

    def info(self) -> dict:
        """The ``model_loaded`` dict: what the status bar and the panels read."""
        return {
            "name": self.model_id, "path": self.base_url, "device": f"server {urlsplit(self.base_url).netloc}",
            "dtype": "", "context_limit": self.context_limit, "load_seconds": self.connect_seconds,
            "remote": True, "base_url": self.base_url, "source": remote_source(self.base_url, self.model_id),
        }

    def open_stream(self, messages: list[dict], settings: "runtime.GenerationSettings"):
        """Start a streamed chat completion (``openai`` errors propagate)."""
        import openai

        kwargs: dict[str, Any] = {"model": self.model_id, "messages": messages, "stream": True,
                                  "temperature": settings.sampling.temperature,
                                  "max_tokens": settings.max_new_tokens}
        sp = settings.sampling
        if sp.seed is not None:
            kwargs["seed"] = sp.seed
        if sp.top_p < 1.0:
            kwargs["top_p"] = sp.top_p
        # Not OpenAI's, but vLLM's, llama.cpp's and attnchat's: sent only when the user set them.
        extensions = {"top_k": sp.top_k, "min_p": sp.min_p, "repetition_penalty": sp.repetition_penalty}
        off = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        extra = {k: v for k, v in extensions.items() if v != off[k]}
        if extra:
            kwargs["extra_body"] = extra
        if self.usage_in_stream:
            try:
                return self.client.chat.completions.create(**kwargs, stream_options={"include_usage": True})
            except openai.BadRequestError as e:
                if "stream_options" not in str(e) and "include_usage" not in str(e):
                    raise
                log.info("%s refuses stream_options; counting chunks instead of tokens", self.base_url)
                self.usage_in_stream = False
        return self.client.chat.completions.create(**kwargs)

    def close(self) -> None:
        self.client.close()
