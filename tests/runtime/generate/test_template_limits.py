"""A chat template is untrusted code: it renders under a time limit and may not multiply
by a huge constant (issue 20: nested ``range(100000)`` loops hung a load, ``'a' * 1000000000``
took 4.1 GiB). Runs on the tiny test tokenizer with planted templates.
"""
from __future__ import annotations

import time

import pytest

from runtime.errors import AttnchatError, ChatTemplateError
from runtime.generate import chat_format
from runtime.generate.chat_format import Message, encode_messages, render
from tests.runtime.tiny_models import CHAT_TEMPLATE, make_tokenizer

HI = [Message("user", "hi")]


@pytest.fixture
def tok():
    return make_tokenizer()


def test_nested_loops_stop_at_the_deadline(tok, monkeypatch):
    monkeypatch.setattr(chat_format, "RENDER_TIMEOUT_S", 0.5)
    tok.chat_template = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                         + CHAT_TEMPLATE)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran for over 0.5 s") as e:
        render(tok, HI)
    assert isinstance(e.value, AttnchatError) and time.monotonic() - t0 < 30


@pytest.mark.parametrize("expr", ["'a' * 1000000000", "1000000000 * 'a'", "'ab' * (2 ** 100)"])
def test_a_huge_repeat_is_refused_before_it_runs(tok, expr):
    tok.chat_template = "{{ " + expr + " }}" + CHAT_TEMPLATE
    with pytest.raises(ChatTemplateError, match="multiplies by"):
        encode_messages(tok, HI)


def test_ordinary_templates_render_as_before(tok):
    assert render(tok, HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{{ '-' * 3 }}" + CHAT_TEMPLATE  # small repeats are fine
    assert render(tok, HI).startswith("---<|im_start|>user")
