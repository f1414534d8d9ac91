"""``--cache-policy`` / ``--cache-budget`` on ``attnchat chat`` (a tiny seeded model, JSON Lines)
and on the server's engine: ``evicted_tokens`` in each reply's figures and the stats."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from attnchat.server.engine import Done, Engine, Job
from runtime import GenerationSettings, Message, SamplingParams, load_model
from tests.runtime.tiny_models import WORDS, make_tiny_model
from tests.hang import HANG_S

ENTRY = Path(sys.executable).parent / "attnchat"
LONG = " ".join(WORDS * 2)  # ~150 tokens with the template


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("policy-cli"), "llama", max_positions=1024)


def test_chat_json_reports_evicted_tokens(folder):
    r = subprocess.run([str(ENTRY), "chat", "--model", str(folder), "--prompt", LONG, "--prompt", "who are you",
                        "--json", "--max-new-tokens", "20", "--cache-policy", "tova", "--cache-budget", "40",
                        "--overflow", "stop"], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    t1, t2 = (json.loads(line) for line in r.stdout.splitlines())
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


def test_bad_cache_options_exit_2_before_loading():
    """Each with a model that does not exist: the option is refused first (the processes run
    side by side: each spends its seconds importing torch)."""
    def run(args):
        return subprocess.run([str(ENTRY), "chat", "--model", "missing.gguf", "--prompt", "hi", *args],
                              capture_output=True, text=True, timeout=HANG_S)

    with ThreadPoolExecutor(len(BAD_OPTIONS)) as pool:
        results = list(pool.map(run, [a for a, _ in BAD_OPTIONS]))
    for (args, words), r in zip(BAD_OPTIONS, results):
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


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
