"""Conversation -> prompt token ids, through the model's chat template.

Must not import Qt. transformers renders the template (Jinja, sandboxed); a model
without one gets a plain "System:/User:/Assistant:" format and a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

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


def encode_messages(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`render` (the template carries its own special tokens)."""
    text = render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
