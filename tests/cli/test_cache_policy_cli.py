"""``--cache-policy`` / ``--cache-budget`` on ``attnchat chat`` (a tiny seeded model, JSON Lines)
and on the server's engine: ``evicted_tokens`` in each reply's figures and the stats."""
from __future__ import annotations

import json
import threading

import pytest

from attnchat.server.engine import Done, Engine, Job
from runtime import GenerationSettings, Message, SamplingParams, load_model
from tests.runtime.tiny_models import WORDS, make_tiny_model

LONG = " ".join(WORDS * 2)  # ~150 tokens with the template


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("policy-cli"), "llama", max_positions=1024)


def test_chat_json_reports_evicted_tokens(folder, attnchat_cli):
    status, out, err = attnchat_cli("chat", "--model", str(folder), "--prompt", LONG, "--prompt", "who are you",
                                    "--json", "--max-new-tokens", "20", "--cache-policy", "tova", "--cache-budget", "40",
                                    "--overflow", "stop")
    assert status == 0, err
    t1, t2 = (json.loads(line) for line in out.splitlines())
    for t in (t1, t2):
        kv = t["kv_cache"]
        assert kv["tokens"] < 40 + 16 and kv["positions"] == kv["tokens"] + kv["evicted_tokens"]
        assert t["evicted_tokens"] == kv["evicted_tokens"] > 0
    assert t1["prompt_tokens"] > 100 and t2["reused_tokens"] >= t1["prompt_tokens"]
    assert t2["evicted_tokens"] > t1["evicted_tokens"]


BAD_OPTIONS = [
    (["--cache-policy", "h2o"], "needs --cache-budget"),
    (["--cache-policy", "lru", "--cache-budget", "9"], "unknown --cache-policy 'lru'"),
    (["--cache-policy", "h2o", "--cache-budget", "lots"], "512"),
    (["--cache-policy", "h2o", "--cache-budget", "64", "--overflow", "rolling"], "rolling"),
]


@pytest.mark.parametrize("args, words", BAD_OPTIONS)
def test_bad_cache_options_exit_2_before_loading(attnchat_cli, args, words):
    """Each with a model that does not exist: the option is refused first (in-process:
    tests/conftest.py ``attnchat_cli``)."""
    status, _, err = attnchat_cli("chat", "--model", "missing.gguf", "--prompt", "hi", *args)
    assert status == 2 and words in err and "Traceback" not in err, (args, err)


def test_server_engine_reports_evicted_tokens(folder):
    model = load_model(folder, device="cpu", dtype="float32")
    engine = Engine(model, settings=GenerationSettings(context_limit=1024, overflow="stop", cache_policy="h2o",
                                                       cache_budget_bytes=40 * model.new_cache(8).bytes_per_token),
                    sessions=1)
    try:
        items: list = []
        done = threading.Event()
        job = Job(system=None, messages=[Message("user", LONG)], sampling=SamplingParams(temperature=0), max_tokens=8,
                  emit=lambda item: (items.append(item), isinstance(item, Done) and done.set()))
        engine.submit(job)
        assert done.wait(120)
        stats = next(i for i in items if isinstance(i, Done)).stats
        assert stats.evicted_tokens > 100 and stats.kv_cache["tokens"] < 40 + 16
        assert engine.stats()["last"][0]["evicted_tokens"] == stats.evicted_tokens
    finally:
        engine.close()
