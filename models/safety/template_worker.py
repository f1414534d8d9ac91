"""The chat-template sandbox's child process: renders Jinja chat templates under an
address-space limit: one request per line on stdin (JSON), one reply on stdout (its length
in bytes on a line, then the JSON).

Run as ``python -m models.safety.template_worker`` (the frozen app: ``attnchat -m
models.safety.template_worker``) by :mod:`models.safety.template`, never by hand. Imports
the stdlib and jinja2 only: started in ~0.1 s, ~20 MB.

Each request sets the soft ``RLIMIT_AS`` to what the process maps now plus the request's
``memory_bytes`` (an allocation past it raises MemoryError, which ends this process
after its reply) and the soft ``RLIMIT_CPU`` to the CPU time used so far plus
``timeout_s`` + 1 (the kernel stops a render the parent can no longer kill). The
environment is transformers' chat-template environment (``chat_template_utils``:
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop controls,
``{% generation %}``, ``raise_exception``, ``strftime_now``, its ``tojson``, ``dict`` and
``namespace``); tests/models/test_safety_template.py checks the two render alike.
"""
from __future__ import annotations

import json
import sys
from typing import Any

#: Appended to the final message's content when it is continued (transformers' tag).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: Compiled templates kept, by their id.
KEEP_TEMPLATES = 8


def _environment():
    import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body (transformers
        marks the assistant's tokens with it; a plain render ignores the marks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _mapped_bytes() -> int | None:
    """Bytes of address space this process maps now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (bytes): Linux's ``VmHWM``, which counts this
    program alone (``ru_maxrss`` keeps the parent's peak from before ``exec``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return 0


def _limit(memory_bytes: int, timeout_s: float) -> bool:
    """Set this request's limits; True when the address-space limit is in force."""
    try:
        import resource
    except ImportError:  # Windows: the parent's kill on timeout is the only bound
        return False
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    used = int(cpu.ru_utime + cpu.ru_stime)
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = used + int(timeout_s) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ValueError, OSError):
        pass
    mapped = _mapped_bytes()
    if mapped is None:
        return False
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = mapped + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ValueError, OSError):
        return False
    return True


def _render(template, request: dict[str, Any]) -> str:
    given = request["given"]
    messages = given["messages"]
    continue_final = request.get("continue_final", False)
    final = None
    if continue_final:
        if not messages:
            raise ValueError("continue_final is set but the conversation is empty")
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ValueError("continue_final is set but the final message has no text to continue")
        if "content" not in request["template_text"]:
            raise ValueError("the chat template never shows a message's content, so a reply cannot be continued")
        messages[-1]["content"] = final + CONTINUE_TAG
    text = template.render(messages=messages, tools=given.get("tools"), documents=None,
                           add_generation_prompt=request.get("add_generation_prompt", False),
                           **given.get("variables", {}))
    if final is not None:
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("the chat template drops part of the reply being continued")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text


def _reply(out, **fields: Any) -> None:
    """One reply: its length in bytes on a line, then that much JSON."""
    fields["peak_rss_bytes"] = _peak_rss_bytes()
    data = json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")
    out.write(b"%d\n" % len(data) + data)
    out.flush()


def main() -> int:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    env = _environment()
    templates: dict[str, Any] = {}
    _reply(out, ready=True, limited=_limit(1 << 30, 60.0))
    while True:
        line = inp.readline()
        if not line:
            return 0
        try:  # the parent writes lone surrogates (valid in JSON text, in Python strings) as surrogatepass
            request = json.loads(line.decode("utf-8", "surrogatepass"))
        except ValueError:
            _reply(out, error="protocol", message="a request that is not JSON")
            return 1
        limited = _limit(int(request["memory_bytes"]), float(request["timeout_s"]))
        try:
            key = request["template_id"]
            template = templates.get(key)
            if template is None:
                if "template" not in request:
                    _reply(out, id=request.get("id"), error="unknown_template")
                    continue
                templates[key] = (env.from_string(request["template"]), request["template"])
                while len(templates) > KEEP_TEMPLATES:
                    templates.pop(next(iter(templates)))
            template, request["template_text"] = templates[key]
            text = _render(template, request)
            if len(text) > int(request["output_chars"]):
                _reply(out, id=request.get("id"), error="output", chars=len(text))
                continue
            _reply(out, id=request.get("id"), text=text, limited=limited)
        except MemoryError:
            template = text = None  # free what can be freed, then leave: the heap may be in pieces
            _reply(out, id=request.get("id"), error="memory", limited=limited)
            return 3
        except RecursionError:
            _reply(out, id=request.get("id"), error="template", message="it recurses without end")
        except Exception as e:  # noqa: BLE001 - the template's own errors, reported in one line
            message = " ".join(str(e).split())[:300] or type(e).__name__
            _reply(out, id=request.get("id"), error="template", message=f"{type(e).__name__}: {message}")


if __name__ == "__main__":
    sys.exit(main())
