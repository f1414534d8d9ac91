"""Conversation -> prompt token ids, through the model's chat template.

Must not import Qt. The template renders in :mod:`models.safety`'s sandbox (Jinja's
sandbox in a child process with bounded memory, time and output, as transformers'
``apply_chat_template`` renders it), never in this process. A model
without one (a base model such as Gemma 3 270M) runs as plain text completion: the
conversation is one text, the messages joined as they are (a system prompt and a blank
line first), which the model continues; the tokenizer adds its own start token (BOS),
as transformers does for ``tokenizer(text)``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from models import safety
from models.safety import template as sandbox
from runtime.errors import ChatTemplateError

log = logging.getLogger(__name__)

#: Between a system prompt and the text, in plain completion.
PLAIN_SYSTEM_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Message:
    """One message of a conversation.

    Attributes:
        role: ``"system"``, ``"user"`` or ``"assistant"``.
        content: its text.
        token_ids: for a reply, the token ids the model generated for exactly ``content``
            (``None``: not known, e.g. an edited or imported reply; it is then
            re-tokenized). Not part of equality: two messages with the same role and
            text are the same message.
    """

    role: str
    content: str
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)


def _plain(messages: Sequence[Message]) -> str:
    """Plain completion: the messages' texts joined as they are, a system prompt first."""
    system = "".join(m.content + PLAIN_SYSTEM_SEPARATOR for m in messages if m.role == "system")
    return system + "".join(m.content for m in messages if m.role != "system")


def render(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
           continue_final: bool = False, tools: Sequence[dict] | None = None) -> str:
    """The prompt text for ``messages`` (the model's chat template, else plain completion).

    With ``continue_final`` the last message is left open (no end-of-turn after it, no
    generation prompt), so what the model generates continues its text: a reply
    "prefill", as llama-server and Ollama do for a trailing assistant message.
    ``tools``: function descriptions in OpenAI's shape (``{"type": "function",
    "function": {...}}``) handed to the template as its ``tools`` variable (a template
    that does not use it ignores them; plain completion never shows them).
    An empty conversation renders as the empty string.

    Raises:
        ChatTemplateError: the template raised, or passed the sandbox's limits on time
            (:data:`RENDER_TIMEOUT_S`), memory or output (:mod:`models.safety.template`).
    """
    if not messages:
        return ""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers' choice (get_chat_template)
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    if template:
        try:
            return safety.render_template(
                template, [{"role": m.role, "content": m.content} for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final=continue_final, variables=_special_tokens(tokenizer),
                timeout_s=RENDER_TIMEOUT_S)
        except safety.Refused as e:
            raise ChatTemplateError(str(e)) from None
    return _plain(messages)


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """What transformers hands a template besides the conversation: the special tokens
    (``bos_token``, ``eos_token``...) as text."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: (str(v) if not isinstance(v, (list, tuple)) else [str(t) for t in v]) for k, v in tokens.items()}


def builtin_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the chat template sends when the conversation has none, or None.

    SmolLM2's template, for one, opens every conversation without a system message with
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face": an empty
    system prompt setting does not mean the model gets none. Found by rendering a
    one-message conversation with and without a system message (markers for the
    texts): what the first has where the second has the system text is the built-in
    prompt. None: no template, a template that adds no system text of its own, or one
    that places a system message somewhere this cannot match (e.g. Gemma 3's, which
    prepends it to the first user message) or refuses it.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    sys_mark, user_mark = "\x00attnchat-system\x00", "\x00attnchat-user\x00"
    try:
        bare = render(tokenizer, [Message("user", user_mark)], add_generation_prompt=False)
        with_sys = render(tokenizer, [Message("system", sys_mark), Message("user", user_mark)],
                          add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that refuses a system message (or ours): unknown
        log.debug("could not render the template for its built-in system prompt", exc_info=True)
        return None
    if bare.count(user_mark) != 1 or with_sys.count(sys_mark) != 1 or with_sys.count(user_mark) != 1:
        return None
    head = bare.split(user_mark, 1)[0]
    before, between = with_sys.split(sys_mark, 1)
    between = between.split(user_mark, 1)[0]
    if len(head) < len(before) + len(between) or not (head.startswith(before) and head.endswith(between)):
        return None
    builtin = head[len(before):len(head) - len(between)].strip()
    return builtin or None


# ---- limits on the template (what rendering one may cost) ------------------------------------
#: A chat template gets this long to render one conversation (seconds): the sandbox's limit
#: (:data:`models.safety.template.TEMPLATE_TIMEOUT_S`); its memory and output are bounded there too.
RENDER_TIMEOUT_S = sandbox.TEMPLATE_TIMEOUT_S


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


@dataclass(frozen=True)
class EncodedPrompt:
    """A conversation's prompt token ids.

    Attributes:
        ids: the prompt's token ids.
        retokenized_tokens: tokens of replies rebuilt from their text (no kept
            ``token_ids``, or a template that rewrites earlier replies); 0 when every
            reply is spliced in as the model wrote it.
    """

    ids: list[int]
    retokenized_tokens: int


def _marker(i: int) -> str:
    # Stands in for reply i while the template renders; no tokenizer ever sees it.
    return f"\x00attnchat-reply-{i}\x00"


def encode_conversation(tokenizer: Any, messages: Sequence[Message], *,
                        add_generation_prompt: bool = True, continue_final: bool = False,
                        tools: Sequence[dict] | None = None) -> EncodedPrompt:
    """Token ids of :func:`render`, with each reply's own ``token_ids`` spliced in.

    Re-tokenizing a reply's text does not give back the ids the model wrote (SmolLM2
    writes "\\n\\n" as one token, 1116, and re-encodes it as 198, 198), and the KV cache
    is only reusable up to the first differing id. So the template renders with a
    marker in place of each reply that has ``token_ids``; the text between markers
    (the template's end-of-turn, the next messages) is tokenized piece by piece and the
    replies' ids go in between: cached ids + end-of-turn + the new message. A template
    that does not place a reply's text verbatim (one that drops earlier replies'
    reasoning, say) gets the plain re-tokenized prompt instead.

    Control tokens typed inside messages are read as text (:func:`neutralize_control_tokens`).
    ``continue_final``, ``tools``: see :func:`render`.
    """
    controls = _control_strings(tokenizer)  # once per call, not per message
    safe = [replace(m, content=_neutralize(m.content, controls)) for m in messages]
    text = render(tokenizer, safe, add_generation_prompt=add_generation_prompt, continue_final=continue_final,
                  tools=tools)

    def encode(t: str) -> list[int]:
        return list(tokenizer.encode(t, add_special_tokens=False)) if t else []

    start = _plain_start(tokenizer) if text else []  # plain completion: the tokenizer's BOS

    spliced = [i for i, m in enumerate(safe) if m.role == "assistant" and m.token_ids is not None]
    if spliced:
        marked = [replace(m, content=_marker(i)) if i in spliced else m for i, m in enumerate(safe)]
        mtext = render(tokenizer, marked, add_generation_prompt=add_generation_prompt, continue_final=continue_final,
                       tools=tools)
        verbatim = mtext
        for i in spliced:
            verbatim = verbatim.replace(_marker(i), safe[i].content)
        if verbatim == text and all(mtext.count(_marker(i)) == 1 for i in spliced):
            ids: list[int] = list(start)
            rest = mtext
            for i in spliced:
                before, rest = rest.split(_marker(i), 1)
                ids += encode(before) + list(safe[i].token_ids)
            ids += encode(rest)
            retok = sum(len(encode(m.content)) for i, m in enumerate(safe)
                        if m.role == "assistant" and i not in spliced)
            return EncodedPrompt(ids, retok)
    retok = sum(len(encode(m.content)) for m in safe if m.role == "assistant")
    return EncodedPrompt(start + encode(text), retok)


def _plain_start(tokenizer: Any) -> list[int]:
    """``[bos]`` when the model has no chat template and its tokenizer starts a plain text
    with BOS (Gemma, Llama), as ``tokenizer(text)`` does; else ``[]`` (a template carries
    its own special tokens)."""
    if getattr(tokenizer, "chat_template", None):
        return []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [bos] if list(tokenizer.encode("a", add_special_tokens=True))[:1] == [bos] else []


def encode_messages(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    continue_final: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
    """The ids of :func:`encode_conversation` (replies' own ids spliced in)."""
    return encode_conversation(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                               continue_final=continue_final, tools=tools).ids


def token_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]] | None:
    """texts -> the token count of each text alone (no template, no special tokens), or
    ``None`` for a tokenizer without a Rust backend.

    A fast estimate of messages' sizes (one batched call in the tokenizer's Rust code,
    no template rendering): :mod:`runtime.generate.context` uses it to trim a long conversation
    without rendering it whole.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return lambda texts: [len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
