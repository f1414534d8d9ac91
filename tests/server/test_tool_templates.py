"""Tools through the model's own chat template where it knows tools, else the fallback
prompt (``attnchat.server.tools.template_renders_tools``), on a tiny seeded model (no socket).

The tiny tokenizer gets a Hermes-style template that renders ``tools`` and ``tool``
messages (as Qwen 2.5's does, much shortened); its own ChatML template knows neither.
Either way the call is generated under the function's schema, so it parses and validates.
"""
from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import jsonschema
import pytest

from attnchat.server import tools
from attnchat.server.app import create_app
from runtime import GenerationSettings, Message, load_model
from runtime.generate.chat_format import encode_messages, render
from tests.runtime.tiny_models import (
    CHAT_TEMPLATE,
    SMOLLM2_TEMPLATE,
    make_tiny_model,
    make_tokenizer,
)

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Mentions ``tools`` and shows them, but drops ``tool`` messages: not enough to use it.
TOOLS_ONLY_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for message in messages %}{% if message.role != 'tool' %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: A template that refuses tools outright.
REFUSING_TEMPLATE = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHAT_TEMPLATE

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                            "parameters": UNIT}}
ASK = [{"role": "user", "content": "what is the weather"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.mark.parametrize("template, knows", [
    (TOOL_TEMPLATE, True), (CHAT_TEMPLATE, False), (SMOLLM2_TEMPLATE, False), (TOOLS_ONLY_TEMPLATE, False),
    (REFUSING_TEMPLATE, False), (None, False),
], ids=["hermes-style", "chatml", "smollm2", "drops-tool-messages", "refuses-tools", "no-template"])
def test_which_templates_render_tools(tokenizer, template, knows):
    tokenizer.chat_template = template
    try:
        assert tools.template_renders_tools(tokenizer) is knows
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024)


def _app(folder, template: str):
    model = load_model(folder, device="cpu", dtype="float32")
    model.tokenizer.chat_template = template
    return model, create_app(model, settings=GenerationSettings(context_limit=1024))


def _post(app, *bodies: dict) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=120) as c:
            out = []
            for body in bodies:
                path = "/v1/attnchat/stats" if body is None else "/v1/chat/completions"
                out.append(await (c.get(path) if body is None else c.post(path, json=body)))
            return out
    return asyncio.run(go())


def _call(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), UNIT)
    return call


def test_tools_go_through_a_template_that_knows_them(folder):
    model, app = _app(folder, TOOL_TEMPLATE)
    try:
        ask = {"model": model.name, "messages": ASK, "tools": [WEATHER], "max_tokens": 120, "temperature": 0,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        first, stats = _post(app, ask, None)
        call = _call(first)
        assert stats.json()["tool_prompt"] == "template"
        # The prompt is the template's rendering with the tools (no fallback prompt anywhere).
        tok = model.tokenizer
        user = Message("user", ASK[0]["content"])
        assert first.json()["usage"]["prompt_tokens"] == len(encode_messages(tok, [user], tools=[WEATHER]))
        assert json.dumps(WEATHER) in render(tok, [user], tools=[WEATHER])
        # The call and its result come back: the result is a tool message the template places.
        reply = first.json()["choices"][0]["message"]
        back = {**ask, "tool_choice": "auto", "max_tokens": 2, "messages": ASK + [
            reply, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]}
        (second,) = _post(app, back)
        assert second.status_code == 200, second.text
        said = Message("assistant", tools.render_call("get_weather", call["function"]["arguments"]))
        convo = [user, said, Message("tool", "sunny")]
        assert "<tool_response>\nsunny\n</tool_response>" in render(tok, convo, tools=[WEATHER])
        assert second.json()["usage"]["prompt_tokens"] == len(encode_messages(tok, convo, tools=[WEATHER]))
        # Same tools, the conversation extended: its pooled session's cache is reused.
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"]
    finally:
        app.state.engine.close()


def test_a_template_without_tools_gets_the_fallback_prompt(folder):
    model, app = _app(folder, CHAT_TEMPLATE)
    try:
        ask = {"model": model.name, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
               "max_tokens": 120, "temperature": 0}
        first, stats = _post(app, ask, None)
        _call(first)
        assert stats.json()["tool_prompt"] == "fallback"
        prompt = [Message("system", tools.system_prompt(tools.parse_tools([WEATHER], None)[0])),
                  Message("user", ASK[0]["content"])]
        assert first.json()["usage"]["prompt_tokens"] == len(encode_messages(model.tokenizer, prompt))
    finally:
        app.state.engine.close()
