"""Chat templates render in a child process whose memory and time are both bounded.

A chat template is code from whoever made the model file. Rendered in attnchat's own
process, one string operation can take gigabytes before any check between steps sees it
(``{{ 'x' * 4000000000 }}`` reached 16 GB in 150 s; doubling a string 40 times 6.7 GB
before a 10 s deadline fired). So templates render in one long-lived child
(:mod:`models.safety.template_worker`: the stdlib and jinja2, ~20 MB), which

- maps at most :data:`TEMPLATE_MEMORY_BYTES` (plus :data:`TEMPLATE_MEMORY_PER_INPUT_BYTE`
  per byte of the request) beyond what it mapped before the render (``RLIMIT_AS``: the
  allocation that would pass it fails, and the child replies and leaves);
- is killed when a render passes :data:`TEMPLATE_TIMEOUT_S` (and the kernel stops it at
  that much CPU time should the parent be gone);
- may return at most :data:`TEMPLATE_OUTPUT_CHARS` plus
  :data:`TEMPLATE_OUTPUT_PER_INPUT_CHAR` per character given to it, so what comes back
  cannot fill the caller's memory or its tokenizer either.

The child starts on the first render (~0.1-0.5 s) and serves every later one; a render
costs a round trip through two pipes on top of the template's own work (measured in
tests/models/test_safety_template.py). Renders are serialized (one lock). Started again
after a kill or a memory refusal. The address-space limit needs Linux (``/proc``); on
other systems only the time limit holds (:func:`memory_limited` says which).

Stdlib only here; jinja2 is imported by the child alone.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from models.child import python_command

from .refused import Refused

log = logging.getLogger(__name__)

#: A render may take this long (seconds); real templates take milliseconds.
TEMPLATE_TIMEOUT_S = 10.0
#: Memory a render may map beyond the child's own (bytes), and per byte of its request.
TEMPLATE_MEMORY_BYTES = 256 << 20
TEMPLATE_MEMORY_PER_INPUT_BYTE = 16
#: Characters a render may return, and per character of its input (messages, tools and
#: special tokens, counted as JSON): templates add markers and reformat tools' JSON, they
#: do not multiply the conversation.
TEMPLATE_OUTPUT_CHARS = 1 << 20
TEMPLATE_OUTPUT_PER_INPUT_CHAR = 4
#: The longest template rendered (characters): real ones are tens of KB; a GGUF's strings
#: and a folder's ``*.jinja`` files have the same limit in bytes.
MAX_TEMPLATE_CHARS = 1 << 20
#: How long the child may take to start (seconds): a busy machine's disk and CPU.
START_TIMEOUT_S = 60.0
#: The longest reply read from the child (bytes): the output limit in UTF-8, plus room.
_REPLY_SLACK_BYTES = 1 << 16
WORKER_MODULE = "models.safety.template_worker"
#: Environment variables the child does not get (API keys, Hub tokens, passwords).
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH", re.IGNORECASE)


class TemplateRefused(Refused):
    """A chat template was stopped or refused; ``str()`` is one line (what, and what to do).

    Attributes:
        kind: ``"memory"``, ``"timeout"``, ``"output"``, ``"template"`` (the template raised,
            e.g. ``raise_exception``), ``"unavailable"`` (the sandbox could not start).
    """


@dataclass(frozen=True)
class RenderStats:
    """The last render's figures: seconds (the round trip), the child's peak resident
    memory in bytes (its whole life so far), and whether its memory limit was in force."""

    seconds: float
    peak_rss_bytes: int
    memory_limited: bool


def _command() -> list[str]:
    return python_command(WORKER_MODULE)


class _Worker:
    """One child process and the thread that reads its replies."""

    def __init__(self) -> None:
        # The child needs no secret: an escape from jinja2's sandbox would find none there.
        env = {k: v for k, v in os.environ.items() if not _SECRET_NAME.search(k)}
        try:
            self.proc = subprocess.Popen(_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as e:
            raise TemplateRefused(f"the chat-template sandbox could not start ({e.strerror or e}); attnchat renders "
                                  "no template outside it", "unavailable") from None
        self.pid = self.proc.pid
        self.replies: queue.Queue[bytes | None] = queue.Queue()
        self.templates: set[str] = set()
        self.limit_bytes = 1 << 20
        threading.Thread(target=self._read, name="template-sandbox-reader", daemon=True).start()
        try:
            ready = self.receive(START_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if ready is None or not ready.get("ready"):
            self.kill()
            raise TemplateRefused("the chat-template sandbox did not start; attnchat renders no template "
                                  "outside it", "unavailable")
        self.memory_limited = bool(ready.get("limited"))

    def _read(self) -> None:
        """Replies into :attr:`replies`: a length line, then that many bytes; one longer than
        :attr:`limit_bytes` (read when it arrives) is never read: None, and the child is done."""
        out = self.proc.stdout
        try:
            while True:
                header = out.readline(32)
                if not header.endswith(b"\n") or not header[:-1].isdigit():
                    break
                n = int(header)
                if n > self.limit_bytes:
                    break
                data = out.read(n)
                if len(data) < n:
                    break
                self.replies.put(data)
        except (OSError, ValueError):
            pass
        self.replies.put(None)

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next reply, or None when the child ended or sent something malformed.

        Raises:
            queue.Empty: nothing within ``timeout`` seconds.
        """
        data = self.replies.get(timeout=timeout)
        if data is None:
            return None
        try:
            return json.loads(data.decode("utf-8", "surrogatepass"))
        except ValueError:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("the template sandbox (pid %d) did not end", self.pid)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """End the child: EOF on its input, then a kill if it lingers."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


_lock = threading.Lock()
_worker: _Worker | None = None
_owner_pid = 0
_last: RenderStats | None = None


def _get_worker() -> _Worker:
    global _worker, _owner_pid
    if _worker is not None and (_owner_pid != os.getpid() or not _worker.alive()):
        if _owner_pid == os.getpid():
            _worker.kill()
        _worker = None  # a forked copy does not share its parent's child
    if _worker is None:
        _worker = _Worker()
        _owner_pid = os.getpid()
    return _worker


def _drop_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.kill()
        _worker = None


@atexit.register
def shutdown() -> None:
    """End the sandbox's child (at exit; safe to call at any time, a later render starts it again)."""
    global _worker
    with _lock:
        if _worker is not None and _owner_pid == os.getpid():
            _worker.close()
        _worker = None


def prestart() -> None:
    """Start the sandbox's child now, in the background, so the first render does not wait
    for it (a model with a chat template was loaded). Errors surface at the first render."""
    def start() -> None:
        with _lock:
            try:
                _get_worker()
            except TemplateRefused:
                pass

    threading.Thread(target=start, name="template-sandbox-start", daemon=True).start()


def last_render() -> RenderStats | None:
    """Figures of the last render in this process (None before the first)."""
    return _last


def memory_limited() -> bool:
    """Whether renders here run under the address-space limit (Linux), starting the child
    if needed."""
    with _lock:
        return _get_worker().memory_limited


def _placeholder(value: Any) -> str:
    """What the template sees for a value that is not JSON (transformers' ``_plain_template_data``)."""
    return f"<{type(value).__name__}>"


def render_template(template: str, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = False, continue_final: bool = False,
                    variables: dict[str, Any] | None = None, timeout_s: float | None = None) -> str:
    """``template`` rendered for ``messages`` in the sandbox, as transformers'
    ``apply_chat_template(..., tokenize=False)`` renders it.

    ``messages``: dicts (``role``, ``content``...); ``tools``: JSON schemas;
    ``variables``: what else the template sees (the tokenizer's special tokens:
    ``bos_token``...). ``continue_final`` leaves the last message open (transformers'
    ``continue_final_message``). ``timeout_s`` defaults to :data:`TEMPLATE_TIMEOUT_S`.

    Raises:
        TemplateRefused: the render passed a limit, the template raised or is longer than
            :data:`MAX_TEMPLATE_CHARS`, or the sandbox could not start (one line each; see its ``kind``).
    """
    global _last
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRefused(f"the model's chat template is {len(template):,} characters long (the limit is "
                              f"{MAX_TEMPLATE_CHARS:,}); pick another model or fix its template", "template")
    timeout = TEMPLATE_TIMEOUT_S if timeout_s is None else timeout_s
    # What the template is given, as JSON once: its size is the input the limits scale with.
    given = json.dumps({"messages": list(messages), "tools": list(tools) if tools else None,
                        "variables": dict(variables or {})}, ensure_ascii=False, default=_placeholder)
    chars = len(given)
    template_id = hashlib.sha1(template.encode("utf-8", "surrogatepass")).hexdigest()
    request: dict[str, Any] = {
        "add_generation_prompt": bool(add_generation_prompt and not continue_final),
        "continue_final": bool(continue_final), "template_id": template_id, "timeout_s": timeout,
        "output_chars": TEMPLATE_OUTPUT_CHARS + TEMPLATE_OUTPUT_PER_INPUT_CHAR * chars,
        "memory_bytes": TEMPLATE_MEMORY_BYTES + TEMPLATE_MEMORY_PER_INPUT_BYTE * (chars + len(template)),
    }
    with _lock:
        for attempt in range(2):
            worker = _get_worker()
            if template_id not in worker.templates or attempt:
                request["template"] = template
            reply, seconds = _exchange(worker, request, given, timeout)
            if reply.get("error") != "unknown_template":  # the child forgot it (it keeps the last few)
                break
        _last = RenderStats(seconds, int(reply.get("peak_rss_bytes", 0)), worker.memory_limited)
        error = reply.get("error")
        if error == "memory":
            _drop_worker()
            raise TemplateRefused(f"the model's chat template needed over {request['memory_bytes'] >> 20:,} MiB to "
                                  "render this conversation; attnchat stopped it: pick another model or fix its "
                                  "template", "memory")
        worker.templates.add(template_id)  # compiled (or refused) in the child
        if error is None:
            return reply["text"]
        if error == "output":
            raise TemplateRefused(f"the model's chat template wrote {reply.get('chars', 0):,} characters for a "
                                  f"conversation of {chars:,} (the limit is {request['output_chars']:,}); "
                                  "pick another model or fix its template", "output")
        raise TemplateRefused(f"the model's chat template refused this conversation ({reply.get('message', error)})",
                              "template")


def _exchange(worker: _Worker, request: dict[str, Any], given: str, timeout: float) -> tuple[dict[str, Any], float]:
    """Send ``request`` (``given``: the template's input, as JSON) to ``worker`` and wait for
    its reply: (reply, seconds).

    Raises:
        TemplateRefused: no reply within ``timeout`` (the child is killed), or the child died.
    """
    global _last
    body = json.dumps(request, ensure_ascii=False)
    line = (body[:-1] + ', "given": ' + given + "}\n").encode("utf-8", "surrogatepass")
    worker.limit_bytes = 4 * request["output_chars"] + _REPLY_SLACK_BYTES
    t0 = time.perf_counter()
    try:
        worker.proc.stdin.write(line)
        worker.proc.stdin.flush()
        reply = worker.receive(timeout)
    except queue.Empty:
        peak = _peak_of(worker.pid)
        _drop_worker()
        _last = RenderStats(time.perf_counter() - t0, peak, worker.memory_limited)
        raise TemplateRefused(f"the model's chat template ran for over {timeout:g} s; attnchat stopped it: "
                              "pick another model or fix its template", "timeout") from None
    except (OSError, ValueError):  # the child is gone (a broken pipe)
        reply = None
    if reply is None:
        _drop_worker()
        raise TemplateRefused("the chat-template sandbox ended while rendering; attnchat renders no template "
                              "outside it: pick another model or fix its template", "unavailable")
    return reply, time.perf_counter() - t0


def _peak_of(pid: int) -> int:
    """Peak resident memory of ``pid`` in bytes (Linux ``VmHWM``), 0 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
