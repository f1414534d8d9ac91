"""The server and the head atlas on the newer families, tiny seeded models (no socket).

Gemma 3 (sliding and global layers, one KV head) without a chat template, as the real
270M file comes, and Qwen3 (q/k norms) with one. ``/v1/completions`` continues a prompt
longer than the window (8 tokens) exactly as plain greedy decoding on a fresh cache does;
``/v1/chat/completions`` on the template-less model renders the messages as plain text;
the head atlas scores every head, and a sliding layer, which cannot see one copy back,
scores no induction.
"""
from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest

from attnchat.server.app import create_app
from runtime import GenerationSettings, Message, load_model
from runtime.generate.chat_format import encode_messages
from runtime.insight.probe import head_scores
from tests.runtime.session_helpers import greedy_ids
from tests.runtime.tiny_models import WINDOW, make_tiny_model

#: 25 tokens with the tiny tokenizer: three windows.
PROMPT = "the cat and the dog were very happy when we came home"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-families")
    out = {}
    for family in ("gemma3", "qwen3"):
        m = load_model(make_tiny_model(root, family), device="cpu", dtype="float32")
        if family == "gemma3":
            m.tokenizer.chat_template = None  # as Gemma 3 270M (a base model) comes
            assert not m.has_chat_template
        out[family] = m
    return out


def _post(model, *requests: tuple[str, dict]) -> list[httpx.Response]:
    app = create_app(model, settings=GenerationSettings(context_limit=128))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=60) as c:
            return [await c.post(path, json={"model": model.name, "temperature": 0, "max_tokens": MAX_TOKENS, **body})
                    for path, body in requests]
    try:
        return asyncio.run(go())
    finally:
        app.state.engine.close()


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_completions_continue_the_prompt_as_greedy_decoding_does(models, family):
    m = models[family]
    ids = list(m.tokenizer.encode(PROMPT))
    assert len(ids) > 3 * WINDOW
    want = m.tokenizer.decode(greedy_ids(m, ids, MAX_TOKENS), skip_special_tokens=True)
    whole, streamed = _post(m, ("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/completions", {"prompt": PROMPT, "stream": True}))
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["choices"][0]["text"] == want and want.strip()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert "".join(e["choices"][0]["text"] for e in _events(streamed) if e["choices"]) == want
    kv = body["attnchat"]["kv_cache"]
    if family == "gemma3":  # 2 sliding layers hold the window, the global one every token
        layer_types = {t["kind"]: t for t in kv["layer_types"]}
        n = len(ids) + body["usage"]["completion_tokens"]
        assert (layer_types["sliding"]["layers"], layer_types["sliding"]["tokens"]) == (2, WINDOW)
        assert (layer_types["full"]["layers"], layer_types["full"]["tokens"]) == (1, n)
    else:
        assert "layer_types" not in kv  # listed for caches with sliding layers only


def test_chat_on_a_model_without_a_template_is_plain_text(models):
    m = models["gemma3"]
    messages = [Message("system", "be brief"), Message("user", "who are you"), Message("assistant", "i am here"),
                Message("user", PROMPT)]
    ids = encode_messages(m.tokenizer, messages)
    assert m.tokenizer.decode(ids) == "be brief\n\nwho are youi am here" + PROMPT  # no template around the texts
    (r,) = _post(m, ("/v1/chat/completions", {"messages": [{"role": x.role, "content": x.content} for x in messages]}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == m.tokenizer.decode(greedy_ids(m, ids, MAX_TOKENS),
                                                                              skip_special_tokens=True)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_the_head_atlas_scores_every_head(models, family):
    m = models[family]
    s = head_scores(m, repeat_len=2 * WINDOW, batch=2)
    c = m.config
    for grid in (s.induction, s.previous_token):
        assert len(grid) == c.n_layers and all(len(row) == c.n_heads for row in grid)
        assert all(0.0 <= x <= 1.0 for row in grid for x in row)
    for layer, w in enumerate(c.windows):
        if w is not None:  # one copy back (16 tokens) is out of an 8-token window
            assert s.induction[layer] == [0.0] * c.n_heads
            assert min(s.previous_token[layer]) > 0
        else:
            assert min(s.induction[layer]) > 0
