"""models.safety.template: chat templates render in a child process whose memory, time and
output are bounded, and render as transformers renders them.

The memory cases are what an attacker would write (``'x' * 4000000000`` and a
string doubled 40 times, and other ways to build a big value in one step); each must stop
inside the child's limit: the child's peak resident memory is measured (``VmHWM`` /
``ru_maxrss``), and so is what this process allocated meanwhile (tracemalloc).
"""
from __future__ import annotations

import tracemalloc

import pytest

from models.safety import template as sandbox
from models.safety.template import TEMPLATE_MEMORY_BYTES, TemplateRefused, last_render, render_template
from tests.runtime.tiny_models import CHAT_TEMPLATE, SMOLLM2_TEMPLATE, make_tokenizer

HI = [{"role": "user", "content": "hi"}]
#: What this process may allocate while the child renders (the request, the reply, a queue).
PARENT_BYTES = 4 << 20
#: The child's own footprint before a render (Python + jinja2: ~25 MB measured) and slack.
CHILD_BASE_BYTES = 96 << 20


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


# ---- the same text as transformers ----------------------------------------------------------
#: Shortened forms of real templates' constructs: Llama 3.1's tools (tojson with indent,
#: namespace, loop.last), Mistral's alternation check (raise_exception, loop.index0 % 2),
#: Qwen 2.5's tool messages, Gemma's role renaming and bos_token, transformers' {% generation %}.
LLAMA31 = (
    "{{- bos_token }}{%- set ns = namespace(sys='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.sys = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ ns.sys }}"
    "{%- if tools is not none %}\nYou may call:\n{%- for t in tools %}{{ t | tojson(indent=4) }}\n\n{%- endfor %}"
    "{%- endif %}<|eot_id|>"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "{%- if not loop.last or m['role'] != 'assistant' %}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% set d = dict(a=1) %}{{ d | tojson(sort_keys=true) }}{% for x in range(3) %}{% if x == 1 %}{% continue %}"
    "{% endif %}{{ x }}{% endfor %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather. é",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TALK = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi <b>there</b>\n"},
        {"role": "assistant", "content": "Hello! How can I help? "}, {"role": "user", "content": "Weather in Zürich?"}]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, SMOLLM2_TEMPLATE, LLAMA31, QWEN_TOOLS, GEMMA, GENERATION],
                         ids=["chatml", "smollm2", "llama31", "qwen-tools", "gemma", "generation-tag"])
@pytest.mark.parametrize("case", ["prompt", "tools", "continue", "no-prompt"])
def test_renders_as_transformers_does(tok, template, case):
    messages = TALK if case != "continue" else TALK[:3]
    kwargs = dict(add_generation_prompt=case in ("prompt", "tools"), continue_final_message=case == "continue")
    tools = [TOOL] if case == "tools" else None
    expected = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, **kwargs)
    got = render_template(template, messages, tools=tools, add_generation_prompt=kwargs["add_generation_prompt"],
                          continue_final=case == "continue", variables=dict(tok.special_tokens_map))
    assert got == expected


def test_a_template_that_refuses_the_conversation_says_why_in_one_line(tok):
    with pytest.raises(TemplateRefused) as e:
        render_template(MISTRAL, TALK[1:] + TALK[1:2], variables=dict(tok.special_tokens_map))
    assert e.value.kind == "template" and "\n" not in str(e.value)
    assert "Conversation roles must alternate" in str(e.value)
    with pytest.raises(TemplateRefused, match="TemplateSyntaxError") as e:
        render_template("{% if %}", HI)
    assert e.value.kind == "template"
    ok = render_template(MISTRAL, [TALK[1], TALK[2], TALK[3]], variables=dict(tok.special_tokens_map))
    assert ok.startswith("<|im_start|>[INST] Hi <b>there</b>\n [/INST]Hello!")  # the child lives on


# ---- bounded memory -----------------------------------------------------------------------------
BOMBS = {
    "repeat-4e9": "{{ 'x' * 4000000000 }}",  # folded into one constant when jinja compiles it
    "double-40": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s | length }}",  # 6.7 GB before a time limit alone would stop it
    "center": "{{ 'x' | center(3000000000) }}",
    "format-width": "{{ '{:>3000000000}'.format('x') }}",
    "list-repeat": "{{ (range(100000) | list) * 100000 }}",
    "percent-width": "{{ '%3000000000d' % 1 }}",
    "json-indent": "{{ [[1]] | tojson(indent=3000000000) }}",
    "nested-join": "{% set a = 'y' * 1000000 %}{{ ([a] * 1000) | join(a) }}",
}


@pytest.mark.parametrize("bomb", list(BOMBS.values()), ids=list(BOMBS))
def test_a_template_that_builds_gigabytes_stops_at_the_memory_limit(bomb):
    if not sandbox.memory_limited():
        pytest.skip("the address-space limit needs Linux")
    tracemalloc.start()
    try:
        with pytest.raises(TemplateRefused) as e:
            render_template(bomb + CHAT_TEMPLATE, HI)
        parent_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    stats = last_render()
    assert e.value.kind == "memory", str(e.value)
    assert str(e.value).startswith("the model's chat template needed over 256 MiB") and "\n" not in str(e.value)
    assert stats.memory_limited
    assert stats.peak_rss_bytes < TEMPLATE_MEMORY_BYTES + CHILD_BASE_BYTES, f"{stats.peak_rss_bytes:,}"
    assert parent_peak < PARENT_BYTES, f"{parent_peak:,}"
    assert render_template(CHAT_TEMPLATE, HI) == "<|im_start|>user\nhi<|im_end|>\n"  # a fresh child


def test_what_a_template_writes_is_bounded_before_it_reaches_this_process():
    tracemalloc.start()
    try:
        with pytest.raises(TemplateRefused) as e:
            # 40 MB, inside the memory limit (a variable: jinja folds constant expressions when it compiles)
            render_template("{% set n = 40000000 %}{{ 'x' * n }}" + CHAT_TEMPLATE, HI)
        parent_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.kind == "output"
    # 81 characters in (the conversation as JSON); 1 MiB + 4 per character out
    assert "wrote 40,000,030 characters for a conversation of 81 (the limit is 1,048,900)" in str(e.value)
    assert parent_peak < PARENT_BYTES, f"{parent_peak:,}"


def test_the_memory_limit_grows_with_the_conversation():
    long = [{"role": "user", "content": "word " * 2_000_000}]  # 10 MB: 16 bytes each on top of 256 MiB
    text = render_template("{% set t = messages[0].content * 3 %}{{ t | length }}" + CHAT_TEMPLATE, long)
    assert text.startswith("30000000<|im_start|>user\nword word")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/environ"), reason="reads /proc/PID/environ")
def test_the_child_gets_no_secrets(monkeypatch):
    monkeypatch.setenv("ATTNCHAT_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    sandbox.shutdown()  # a fresh child, started with this environment
    assert render_template(CHAT_TEMPLATE, HI) == "<|im_start|>user\nhi<|im_end|>\n"
    with open(f"/proc/{sandbox._get_worker().pid}/environ", "rb") as f:
        names = {entry.split(b"=", 1)[0] for entry in f.read().split(b"\0") if entry}
    assert b"PATH" in names and not names & {b"ATTNCHAT_API_KEY", b"HF_TOKEN"}


# ---- bounded time -------------------------------------------------------------------------------
def test_a_loop_without_end_is_killed_at_the_deadline():
    before = sandbox._get_worker().pid
    with pytest.raises(TemplateRefused) as e:
        render_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", HI,
                        timeout_s=1.0)
    assert e.value.kind == "timeout" and str(e.value).startswith("the model's chat template ran for over 1 s")
    assert 1.0 <= last_render().seconds < 10
    assert render_template(CHAT_TEMPLATE, HI) == "<|im_start|>user\nhi<|im_end|>\n"
    assert sandbox._get_worker().pid != before  # killed, and started again


def test_a_template_longer_than_any_real_one_is_refused_unrendered():
    """A template over 1 MiB (tokenizer_config.json may hold 64 MiB) is refused before it goes to
    the child, whose memory limit would otherwise grow with it (16 bytes a character)."""
    with pytest.raises(TemplateRefused) as e:
        render_template("{# " + "x" * sandbox.MAX_TEMPLATE_CHARS + " #}" + CHAT_TEMPLATE, HI)
    assert e.value.kind == "template"
    assert str(e.value) == ("the model's chat template is 1,048,755 characters long (the limit is 1,048,576); "
                            "pick another model or fix its template")
