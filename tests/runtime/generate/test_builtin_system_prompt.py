"""The system prompt a chat template sends on its own when none is set (SmolLM2's sends
"You are a helpful AI assistant named SmolLM…"): found, so the settings can name it instead
of saying "No system prompt". Runs on the tiny test tokenizer with real models' templates planted.
"""
from __future__ import annotations

import pytest

from runtime.generate.chat_format import Message, builtin_system_prompt, render
from tests.runtime.tiny_models import SMOLLM2_TEMPLATE as SMOLLM2
from tests.runtime.tiny_models import make_tokenizer

#: Qwen2.5's default, in its template's own shape (a system message else its default).
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
)
#: Gemma 3's way: a system message is prepended to the first user turn; none of its own.
GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}<start_of_turn>{{ message['role'] }}\n"
    "{{ (first if loop.first else '') + message['content'] }}<end_of_turn>\n{%- endfor -%}"
)
#: A template that refuses a system message.
REFUSES = ("{%- for message in messages %}{% if message.role == 'system' %}"
           "{{ raise_exception('System role not supported') }}{% endif %}{{ message.content }}{% endfor %}")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("template, expected", [
    (SMOLLM2, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    (QWEN25, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    (GEMMA3, None),
    (REFUSES, None),
    (None, None),
])
def test_the_builtin_prompt_is_what_the_template_sends_without_one(tok, template, expected):
    tok.chat_template = template
    assert builtin_system_prompt(tok) == expected
    if expected:   # and it is what a conversation with no system message really renders
        assert expected in render(tok, [Message("user", "hi")])
        assert expected not in render(tok, [Message("system", "Be brief."), Message("user", "hi")])


def test_the_tiny_chatml_template_adds_none(tok):
    tok.chat_template = make_tokenizer().chat_template
    assert builtin_system_prompt(tok) is None
