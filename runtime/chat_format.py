"""Conversation -> prompt token ids, through the model's chat template.

Must not import Qt. transformers renders the template (Jinja, sandboxed); a model
without one gets a plain "System:/User:/Assistant:" format and a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: Stop string that ends a reply in the plain fallback format.
PLAIN_STOP = "\nUser:"


@dataclass(frozen=True)
class Message:
    """One message of a conversation.

    Attributes:
        role: ``"system"``, ``"user"`` or ``"assistant"``.
        content: its text.
    """

    role: str
    content: str


def _plain(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    text = "".join(f"{names.get(m.role, m.role.title())}: {m.content}\n" for m in messages)
    return text + ("Assistant:" if add_generation_prompt else "")


def render(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (the model's chat template, else a plain format).

    An empty conversation renders as the empty string.
    """
    if not messages:
        return ""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    return _plain(messages, add_generation_prompt)


#: Inserted after the first character of a control-token string found in a message, so
#: the tokenizer reads it as text (U+2060 WORD JOINER: invisible, no meaning of its own).
_BREAK = "\u2060"


def _control_strings(tokenizer: Any) -> tuple[str, ...]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return tuple(s for s in specials if len(s) > 1)


def _neutralize(text: str, controls: Sequence[str]) -> str:
    for s in controls:
        if s in text:
            text = text.replace(s, s[0] + _BREAK + s[1:])
    return text


def neutralize_control_tokens(tokenizer: Any, text: str) -> str:
    """``text`` with the tokenizer's control-token strings (``<|im_end|>`` ...) broken up.

    Tokenizers parse special-token strings anywhere in their input, so a message that
    contains ``<|im_end|>`` would otherwise end its own turn and let a pasted text
    forge the template (llama.cpp likewise tokenizes user text with special-token
    parsing off). Only the prompt the model sees changes; the stored message does not.
    """
    return _neutralize(text, _control_strings(tokenizer))


def encode_messages(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`render` (the template carries its own special tokens; control
    tokens typed inside messages are read as text, see :func:`neutralize_control_tokens`)."""
    controls = _control_strings(tokenizer)  # once per call, not per message
    safe = [Message(m.role, _neutralize(m.content, controls)) for m in messages]
    text = render(tokenizer, safe, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]] | None:
    """texts -> the token count of each text alone (no template, no special tokens), or
    ``None`` for a tokenizer without a Rust backend.

    A fast estimate of messages' sizes (one batched call in the tokenizer's Rust code,
    no template rendering): :mod:`runtime.context` uses it to trim a long conversation
    without rendering it whole.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return lambda texts: [len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
