"""A chat template is untrusted code: every render of chat, serve, the
tool-support probe and the desktop goes through :func:`runtime.generate.chat_format.render`,
which renders in models.safety's sandbox. Rendered in this process, the bomb templates
would reach 16 GB (``'x' * 4000000000``) and 6.7 GB (a string doubled 40 times); here
they stop inside the sandbox's limit, this process allocates almost nothing meanwhile
(tracemalloc), and the refusal is one ChatTemplateError line.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from models.safety import template as sandbox
from runtime.errors import AttnchatError, ChatTemplateError
from runtime.generate import chat_format
from runtime.generate.chat_format import Message, builtin_system_prompt, encode_messages, render
from tests.runtime.tiny_models import CHAT_TEMPLATE, make_tokenizer

HI = [Message("user", "hi")]
REPEAT = "{{ 'x' * 4000000000 }}"
DOUBLE = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


@pytest.fixture
def tok():
    return make_tokenizer()


def _measured(fn):
    """(exception raised by fn, bytes this process allocated at the peak, seconds)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError) as e:
            fn()
        return e.value, tracemalloc.get_traced_memory()[1], time.monotonic() - t0
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("bomb", [REPEAT, DOUBLE], ids=["repeat-4e9", "double-40"])
def test_bomb_templates_stop_inside_the_sandbox(tok, bomb):
    if not sandbox.memory_limited():
        pytest.skip("the address-space limit needs Linux")
    tok.chat_template = bomb + CHAT_TEMPLATE
    error, parent_peak, seconds = _measured(lambda: encode_messages(tok, HI))
    assert isinstance(error, AttnchatError) and "\n" not in str(error)
    assert str(error).startswith("the model's chat template needed over 256 MiB to render this conversation")
    assert sandbox.last_render().peak_rss_bytes < 384 << 20, f"{sandbox.last_render().peak_rss_bytes:,}"
    assert parent_peak < 4 << 20, f"{parent_peak:,}"
    assert seconds < chat_format.RENDER_TIMEOUT_S  # stopped by memory, not by the clock


def test_nested_loops_stop_at_the_deadline(tok, monkeypatch):
    monkeypatch.setattr(chat_format, "RENDER_TIMEOUT_S", 0.5)
    tok.chat_template = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                         + CHAT_TEMPLATE)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran for over 0.5 s") as e:
        render(tok, HI)
    assert isinstance(e.value, AttnchatError) and time.monotonic() - t0 < 30


def test_a_template_that_raises_is_one_line(tok):
    tok.chat_template = "{{ raise_exception('System role not supported') }}" + CHAT_TEMPLATE
    with pytest.raises(ChatTemplateError) as e:
        render(tok, HI)
    assert str(e.value) == ("the model's chat template refused this conversation "
                            "(TemplateError: System role not supported)")


def test_the_builtin_system_prompt_and_the_tool_probe_survive_a_bomb(tok):
    """Both render at load and at serve start-up: a bomb gives 'none' / the fallback prompt."""
    from attnchat.server.tools import template_renders_tools

    tok.chat_template = REPEAT + CHAT_TEMPLATE
    tracemalloc.start()
    try:
        assert builtin_system_prompt(tok) is None
        assert template_renders_tools(tok) is False
        parent_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert parent_peak < 4 << 20, f"{parent_peak:,}"


def test_ordinary_templates_render_as_before(tok):
    assert render(tok, HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{{ '-' * 3 }}" + CHAT_TEMPLATE  # small repeats are fine
    assert render(tok, HI).startswith("---<|im_start|>user")
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE  # the special tokens are there, as in transformers
    assert render(tok, HI).startswith("<|im_start|><|im_start|>user")


def test_a_conversation_that_becomes_no_tokens_is_one_line(tmp_path):
    """A stranger's template and tokenizer can give no token for a message (found outside the
    suite: a GGUF whose vocabulary cannot spell 'hi'); the reply was 'internal error: TypeError'."""
    from runtime import ChatSession, GenerationSettings, load_model
    from tests.runtime.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32")
    model.tokenizer.chat_template = "{% for m in messages %}{% endfor %}"  # renders nothing
    session = ChatSession(model, settings=GenerationSettings(max_new_tokens=2))
    with pytest.raises(ChatTemplateError) as e:
        session.run(session.send("hi"))
    assert str(e.value) == ("the model's chat template and tokenizer turned this conversation into no tokens; "
                            "pick another model or fix its template")
    assert session.messages == []  # nothing half-stored
