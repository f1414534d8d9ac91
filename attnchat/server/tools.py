"""Tool calls for the chat endpoint: OpenAI's ``tools`` and ``tool_choice``.

The tools reach the model one of two ways, chosen per model by :func:`template_renders_tools`:

- **The model's own chat template**, when it knows tools (it renders the ``tools``
  variable and ``role: "tool"`` messages, as Qwen 2.5/3 and Hermes-style templates do): the request's tools go to the template (``apply_chat_template(...,
  tools=...)``, under the template limits of :mod:`runtime.generate.chat_format`) and tool
  results stay ``tool`` messages for the template to place.
- **The fallback prompt** (:func:`system_prompt`, appended to the system prompt) for
  every other template (SmolLM2's knows no tools) and for models without one (Gemma 3
  270M, a base model, has none: the conversation reaches it as plain text); tool results
  become user messages (:func:`render_result`).

Either way a call is written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the form Hermes-style templates ask for) and generated under a grammar
(:func:`grammar_source`) built from the functions' JSON schemas, closed and bounded
(:mod:`runtime.generate.json_bounds`), so it always parses, its arguments validate and it ends:

- ``auto``: the reply is free text (not starting with ``<``) or exactly one call;
- ``required`` or a named function: the reply is one call (of that function);
- ``none`` (or no tools): plain text, no tools in the prompt.

Earlier calls (assistant ``tool_calls``) are rendered in that same form as the
assistant's text, so a reply sent back as this server wrote it keeps its token ids. One
call per reply (``parallel_tool_calls`` is accepted and has no effect). A call cut short is
returned as OpenAI does, the arguments so far (:func:`parse_cut`). Must not import Qt.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

log = logging.getLogger("attnchat.serve")


class ToolError(ValueError):
    """A bad ``tools`` or ``tool_choice`` value: ``args`` are (param, message)."""


@dataclass(frozen=True)
class Tool:
    """A function offered to the model. ``parameters``: its JSON schema as the client sent
    it (shown to the model); ``strict``: the client's ``function.strict`` (only an
    explicit ``False`` keeps objects open in the grammar, see :func:`grammar_source`)."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's shape, as chat templates take it (``{"type": "function", ...}``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(tools: list[Any] | None, tool_choice: Any) -> tuple[list[Tool], str | None]:
    """(the tools offered for this reply, the function the reply must call or ``"*"`` for any
    of them, ``None`` when the model may answer in text).

    Raises:
        ToolError: a malformed tool, a duplicate or bad name, an unknown ``tool_choice``.
    """
    parsed: list[Tool] = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1-64 letters, digits, "
                                                          f"'_', '.' or '-' (got {name!r}).")
        if any(p.name == name for p in parsed):
            raise ToolError(f"tools[{i}].function.name", f"Two tools are named {name!r}; names must differ.")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema object.")
        from runtime.generate.json_finite import NoFiniteValue, check_finite

        try:
            check_finite(params)
        except NoFiniteValue as e:
            raise ToolError(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters: {e}.") from None
        strict = fn.get("strict")
        parsed.append(Tool(name, str(fn.get("description") or ""), params,
                           strict if isinstance(strict, bool) else None))
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not any(t.name == name for t in parsed):
            raise ToolError("tool_choice", f"tool_choice names the function {name!r}, which is not in 'tools'.")
        return [t for t in parsed if t.name == name], name
    if choice not in ("auto", "none", "required"):
        raise ToolError("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or "
                                       f"{{'type': 'function', 'function': {{'name': ...}}}} (got {choice!r}).")
    if choice == "none" or not parsed:
        if choice == "required":
            raise ToolError("tool_choice", "tool_choice is 'required' but no tools were given.")
        return [], None
    return parsed, ("*" if choice == "required" else None)


#: A tool and a tool result no conversation holds: :func:`template_renders_tools` looks for them.
_PROBE = Tool("attnchat_probe_fn", "Probe.", {"type": "object", "properties": {}})
_PROBE_RESULT = "attnchat-probe-result"


def template_renders_tools(tokenizer: Any) -> bool:
    """True when ``tokenizer``'s chat template shows a request's tools itself.

    Decided by rendering, not by reading the template: a conversation with a probe tool
    must show the tool's name (and show it only when the tool is given), and a ``tool``
    message after a call must show its content. A template that fails either, raises,
    or runs past the template limits (:mod:`runtime.generate.chat_format`) gets the fallback
    prompt. Renders three short conversations (milliseconds for real templates).
    """
    from runtime.generate.chat_format import Message, render

    if not getattr(tokenizer, "chat_template", None):
        return False
    ask = [Message("user", "Hi.")]
    try:
        shown = render(tokenizer, ask, tools=[_PROBE.openai()])
        if _PROBE.name not in shown or _PROBE.name in render(tokenizer, ask):
            return False
        after = ask + [Message("assistant", render_call(_PROBE.name, {})), Message("tool", _PROBE_RESULT)]
        return _PROBE_RESULT in render(tokenizer, after, tools=[_PROBE.openai()])
    except Exception as e:  # a template that refuses these (or its limits): the fallback
        log.info("the chat template cannot render tools (%s: %s); using the fallback prompt",
                 type(e).__name__, e)
        return False


def system_prompt(tools: list[Tool]) -> str:
    """The fallback prompt that describes ``tools`` (appended to the system prompt)."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                   ensure_ascii=False) for t in tools)
    return ("You can call functions. To call one, reply with only " + OPEN
            + '{"name": <function name>, "arguments": <arguments as a JSON object>}' + CLOSE
            + " and nothing else. Otherwise answer normally. The functions:\n" + listing)


def grammar_source(tools: list[Tool], forced: str | None, budget: int | None = None) -> str:
    """The llguidance Lark grammar of a reply: one call, or (``forced`` None) text or one call.

    The arguments follow each function's schema closed and bounded
    (:func:`runtime.generate.json_bounds.for_generation`): objects that leave
    ``additionalProperties`` unset get ``false`` whatever the tool's ``strict`` says (it is a
    default, not a wish for invented keys), numbers at most 15 digits before the point and
    6 after, arrays, strings and open values capped, the caps chosen so that with a
    ``budget`` (tokens) the longest call fits it (:func:`runtime.generate.json_bounds.fit`'s
    rule). Without that the default model filled a plain ``{"city": ...}`` object with
    invented keys and a ``15.000000…`` until its token limit.
    """
    from runtime.generate import json_bounds

    caps = _call_caps(tools, budget)
    calls, any_used = [], False
    for i, t in enumerate(tools):
        args, uses_any = json_bounds.for_generation(t.parameters, ref_base=f"/anyOf/{i}/properties/arguments",
                                                    caps=caps)
        any_used |= uses_any
        calls.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"anyOf": calls,
                              "x-guidance": {"whitespace_flexible": False, "json_allowed_escapes": json_bounds.ESCAPES}}
    if any_used:
        schema = json_bounds.with_any(schema, caps)
    call = f'call: "{OPEN}" body "{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
    if forced is not None:
        return "start: call\n" + call
    # Free text may not start with "<": the first character tells a call from an answer.
    return "start: text | call\n" + call + "text: /[^<][\\s\\S]*/\n"


def _call_caps(tools: list[Tool], budget: int | None):
    """The first caps of :data:`runtime.generate.json_bounds.CAP_STEPS` under which every
    tool's longest call (the tags and its name around the arguments) fits ``budget`` tokens."""
    from runtime.generate import json_bounds

    if budget is None:
        return json_bounds.DEFAULT_CAPS
    for caps in json_bounds.CAP_STEPS:
        worst = 0.0
        for t in tools:
            args, uses_any = json_bounds.for_generation(t.parameters, caps=caps)
            size = json_bounds.max_tokens(json_bounds.with_any(args, caps) if uses_any and isinstance(args, dict) else args)
            wrapper = len((OPEN + '{"name":' + json.dumps(t.name) + ',"arguments":}' + CLOSE).encode())
            worst = max(worst, size + wrapper)
        if worst <= budget:
            return caps
    return json_bounds.CAP_STEPS[-1]


def render_call(name: str, arguments: str | dict) -> str:
    """An earlier call as the model writes one (arguments re-encoded compactly)."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        args = arguments
    return OPEN + json.dumps({"name": name, "arguments": args}, ensure_ascii=False, separators=(",", ":")) + CLOSE


def render_result(name: str | None, content: str) -> str:
    """A tool's result as the user message the model reads."""
    return f"<tool_response{f' name={json.dumps(name)}' if name else ''}>\n{content}\n</tool_response>"


def parse_reply(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` in a reply, or ``None`` when it is plain text (or a call cut short)."""
    m = _CALL.search(text)
    if m is None or not is_call(text):
        return None
    try:
        call = json.loads(m.group(1))
    except ValueError:
        return None
    return [_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]


def is_call(text: str) -> bool:
    """True when ``text`` is (the start of) a call rather than an answer in words."""
    head = text.lstrip()[: len(OPEN)]
    return bool(head) and OPEN.startswith(head)


#: A call as the grammar writes it (compact JSON, the name first), possibly cut short.
_PARTIAL = re.compile(r"\s*" + re.escape(OPEN) + r'\{"name":"([A-Za-z0-9_.-]{1,64})","arguments":(.*)\Z', re.S)


def parse_cut(text: str) -> list[dict[str, Any]] | None:
    """The ``tool_calls`` of a call the token limit cut short, as OpenAI returns one: the
    name and the ``arguments`` written so far (a JSON text that may not parse; complete
    when only the closing tag was cut). ``None`` while the name is unfinished."""
    m = _PARTIAL.match(text)
    if m is None:
        return None
    name, args = m.groups()
    try:
        value, _ = json.JSONDecoder().raw_decode(args)
        args = json.dumps(value, ensure_ascii=False)  # whole (only the closing was cut): as parse_reply gives them
    except ValueError:
        pass
    return [_call(name, args)]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
