"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status OpenAI would use, and the handlers that turn every failure into one.

400 bad values (and ``context_length_exceeded``), 401 a bad or missing API key, 404
unknown routes and models, 405, 408 a body too slow, 413 a body over the limit, 429 a
full queue, 500 a bug, 503 a server shutting down. Must not import Qt.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnchat.server.engine import Failed, Item
from runtime import ChatTemplateError, ContextOverflowError, ModelFileChanged

log = logging.getLogger("attnchat.serve")


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``messages[0].content``."""
    if not loc:
        return None
    name = str(loc[0])
    if name == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        name += f"[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ("role", "content"):
            name += f".{loc[2]}"
    return name


def from_validation(errors: list[dict[str, Any]]) -> APIError:
    """The first of pydantic's ``errors`` (a bad or missing field, a body that is not JSON) as a 400."""
    e = errors[0]
    kind, loc = e.get("type", ""), tuple(x for x in e.get("loc", ()) if x != "body")
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request ({e['msg']}); "
                             "send a JSON object (see https://platform.openai.com/docs/api-reference).")
    if not loc:
        return APIError(400, "The request body must be a JSON object.", code="invalid_type")
    param = _param(loc)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"Invalid value for '{param}': {e['msg'][:1].lower() + e['msg'][1:]} (got {got}).",
                     param=param, code=code)


def overflow_error(e: ContextOverflowError, what: str = "messages") -> APIError:
    """400 ``context_length_exceeded`` worded as OpenAI words it (litellm matches "maximum
    context length"), then the code and our own advice (langchain-openai matches the code
    in the text, which the openai client reduces to the message)."""
    text = str(e)
    return APIError(400, f"This model's maximum context length is {e.context_limit} tokens. However, your "
                         f"{what} resulted in {e.prompt_tokens} tokens. Please reduce the length of the {what}. "
                         f"(context_length_exceeded: {text}.)", param=what, code="context_length_exceeded")


def no_model(name: str, model_id: str) -> APIError:
    """404 for a request naming a model this server does not serve."""
    return APIError(404, f"The model '{name}' does not exist; this server serves '{model_id}' (GET /v1/models).",
                    param="model", code="model_not_found")


def failure(item: Item) -> JSONResponse:
    """The response for a job that ended without a reply: a failure, or the engine closing."""
    if isinstance(item, Failed) and isinstance(item.error, ContextOverflowError):
        return overflow_error(item.error).response()
    if isinstance(item, Failed) and isinstance(item.error, ChatTemplateError):
        # The model's template refused this conversation or passed the sandbox's limits
        # (models.safety.template): retrying the same request cannot help, hence no 5xx.
        return APIError(400, f"The model's chat template could not render this conversation: {item.error}",
                        code="chat_template_error").response()
    if isinstance(item, Failed) and isinstance(item.error, ModelFileChanged):
        # The model in memory is intact, but no longer the file: the operator reloads it.
        return APIError(503, f"{item.error}.", type="server_error", code="model_file_changed").response()
    if isinstance(item, Failed):
        return APIError(500, f"The server failed to answer: {type(item.error).__name__}: {item.error}",
                        type="server_error").response()
    return APIError(503, "The server is shutting down; the request was not answered.",
                    type="server_error", code="unavailable").response()


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 unknown route, 405) in OpenAI's shape."""
    if e.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})."
    elif e.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(e.detail)
    return APIError(e.status_code, message, headers=getattr(e, "headers", None)).response()


async def internal_error(request: Request, e: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered as a 500 that names only its type."""
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(500, f"The server failed to answer: {type(e).__name__}.", type="server_error").response()
