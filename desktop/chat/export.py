"""A conversation exported: Markdown for people, JSON for programs, each with the system
prompt and the settings that shaped its replies.

Each reply stores what it was written with in ``stats["settings"]`` (the window adds it:
the model, the system prompt the model saw, sampling, length, context and cache). An
export starts with the first reply's system prompt and settings, and says where a later
reply was written with other ones. Replies saved before settings were recorded have none,
and the export says nothing it does not know.

Plain data in, text out: no Qt, no torch.
"""
from __future__ import annotations

import re
from dataclasses import asdict
from typing import Iterable

__all__ = ["SETTING_NAMES", "conversation_json", "conversation_markdown", "describe_settings"]

NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}

#: The settings an export names, in order, with how each reads in Markdown.
SETTING_NAMES = {
    "model": "model", "temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
    "repetition_penalty": "repetition penalty", "seed": "seed", "max_new_tokens": "max new tokens",
    "context": "context", "cache_dtype": "KV-cache dtype", "cache_limit_mib": "KV-cache limit (MiB)",
    "overflow": "overflow", "sink_tokens": "sink tokens",
}
#: Values that mean "off" or "the default", said in words.
_WORDS = {("seed", -1): "random", ("context", 0): "the model's maximum", ("cache_limit_mib", 0): "none",
          ("top_k", 0): "off", ("cache_dtype", "auto"): "auto (the model's default)"}


_FENCE = re.compile(r"(`{3,}|~{3,})(.*)")


def _closed_fences(text: str) -> str:
    """``text`` with a code fence it leaves open closed at its end (a reply stopped, or cut at
    its length limit, inside a code block): in the exported file an open fence ran on over
    every section after it. Fences are found at any indentation (small models indent a list
    item's fences); a text whose fences all close is left as written."""
    open_marks = None
    for line in text.split("\n"):
        m = _FENCE.match(line.lstrip(" "))
        if m is None:
            continue
        marks, rest = m.group(1), m.group(2)
        if open_marks is None:
            if not (marks[0] == "`" and "`" in rest):   # an info string holds no backtick
                open_marks = marks
        elif marks[0] == open_marks[0] and len(marks) >= len(open_marks) and not rest.strip():
            open_marks = None
    return text if open_marks is None else f"{text}\n{open_marks}"


def _settings_of(messages) -> list[dict | None]:
    """Each message's settings (replies only; None for the others and for replies without)."""
    return [(m.stats or {}).get("settings") if m.role == "assistant" else None for m in messages]


def _value(key: str, value) -> str:
    if (key, value) in _WORDS:
        return _WORDS[(key, value)]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if key == "seed":
        return str(value)   # a number to type back in, not a quantity
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def describe_settings(settings: dict, only: Iterable[str] | None = None) -> str:
    """``"model SmolLM2 · temperature 0 · ..."`` (the keys of :data:`SETTING_NAMES` present, or ``only``)."""
    keys = [k for k in SETTING_NAMES if k in settings and (only is None or k in only)]
    return " · ".join(f"{SETTING_NAMES[k]} {_value(k, settings[k])}" for k in keys)


def _system_block(settings: dict) -> str:
    prompt = str(settings.get("system_prompt") or "").rstrip()
    source = settings.get("system_prompt_from", "")
    if not prompt:
        return "_No system prompt._\n"
    note = "_The model's chat template's own system prompt (none was set):_\n\n" if source == "template" else ""
    return f"{note}{prompt}\n"


def conversation_markdown(conv, messages) -> str:
    """The conversation as Markdown: the title, the system prompt and settings of its first
    reply, then one section per message (a note before a reply written with other settings)."""
    parts = [f"# {conv.title}\n"]
    used = _settings_of(messages)
    first = next((s for s in used if s), None)
    if first:
        parts.append(f"## System\n\n{_system_block(first)}")
        parts.append(f"_Settings: {describe_settings(first)}_\n")
    last = first
    for m, settings in zip(messages, used):
        if settings and last and settings is not first:
            changed = [k for k in SETTING_NAMES if settings.get(k) != last.get(k)]
            if settings.get("system_prompt") != last.get("system_prompt"):
                parts.append(f"## System (changed for the next reply)\n\n{_system_block(settings)}")
            if changed:
                parts.append(f"_Settings changed for the next reply: {describe_settings(settings, changed)}_\n")
        if settings:
            last = settings
        parts.append(f"## {NAMES.get(m.role, m.role)}\n\n{_closed_fences(m.content.rstrip())}\n")
    return "\n".join(parts)


def conversation_json(conv, messages) -> dict:
    """The conversation as a JSON-ready dict: title, times, model, the first reply's system
    prompt and settings, and the messages with their stats (each reply's settings in them)."""
    first = next((s for s in _settings_of(messages) if s), None) or {}
    return {
        "format": "attnchat-conversation", "version": 1,
        **asdict(conv),
        "system_prompt": first.get("system_prompt"),
        "settings": {k: v for k, v in first.items() if k not in ("system_prompt", "system_prompt_from")} or None,
        # Token ids belong to one model's tokenizer: not part of an export.
        "messages": [{k: v for k, v in asdict(m).items() if k not in ("token_ids", "token_model")}
                     for m in messages],
    }
