"""A chat template that would take gigabytes: ``attnchat serve`` renders it at
start-up (the tool-support probe) and for every request. The probe falls back to the tool
prompt, and a request gets one error JSON (400 ``chat_template_error``), while the render
stays inside the sandbox's memory limit (a tiny seeded model, no socket).
"""
from __future__ import annotations

import asyncio
import tracemalloc

import httpx2 as httpx
import pytest

from attnchat.server.app import create_app
from models.safety import template as sandbox
from runtime import GenerationSettings, load_model
from tests.runtime.tiny_models import CHAT_TEMPLATE, make_tiny_model

BOMB = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024),
                   device="cpu", dtype="float32")
    m.tokenizer.chat_template = BOMB + CHAT_TEMPLATE
    return m


def _post(app, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=120) as c:
            stats = await c.get("/v1/attnchat/stats")
            return stats, await c.post("/v1/chat/completions", json=body)
    return asyncio.run(go())


def test_a_template_bomb_gets_the_fallback_at_start_and_one_error_per_request(model):
    if not sandbox.memory_limited():
        pytest.skip("the address-space limit needs Linux")
    tracemalloc.start()
    try:
        app = create_app(model, settings=GenerationSettings(context_limit=1024))  # renders the tool probe
        probe_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert probe_peak < 8 << 20, f"{probe_peak:,}"
    assert sandbox.last_render().peak_rss_bytes < 384 << 20
    stats, r = _post(app, {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert stats.json()["tool_prompt"] == "fallback"
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {
        "message": "The model's chat template could not render this conversation: the model's chat template needed "
                   "over 256 MiB to render this conversation; attnchat stopped it: pick another model or fix its "
                   "template", "type": "invalid_request_error", "param": None, "code": "chat_template_error"}}
    assert sandbox.last_render().peak_rss_bytes < 384 << 20
