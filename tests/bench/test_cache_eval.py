"""``attnchat cache-eval``: the trials it builds, that reading a prompt once for every policy
equals reading it for each alone, and the command's report on a tiny random model."""
from __future__ import annotations

import json

import pytest
import torch

from attnchat.bench import cache_eval as ce
from attnchat.bench import cache_eval_texts as texts
from runtime import load_model
from tests.runtime.tiny_models import make_tiny_model



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cache-eval"), "llama", max_positions=4096)


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder, device="cpu", dtype="float32")


def test_trials_hide_one_needle_at_each_depth(model):
    trials = ce.make_trials(model.tokenizer, depths=(0.1, 0.5, 0.9), needles=2, length=2500)
    assert [(t.depth, t.thing) for t in trials] == [(d, thing) for thing in ("locker", "garage door") for d in (0.1, 0.5, 0.9)]
    tok = model.tokenizer
    for t in trials:
        text = tok.decode(t.ids)
        assert len(t.ids) >= 2500 and text.count(t.code) == 1  # filler holds no digits
        assert text.endswith(texts.question(t.thing)[1])  # the reply is left open
        assert tok.decode(t.ids[t.needle_at:]).startswith("<|im_start|>user\nPlease remember this")
    depths = [t.token_depth for t in trials[:3]]
    assert depths == sorted(depths) and 0.05 < depths[0] < 0.25 and 0.75 < depths[2] < 0.95
    assert not any(ch.isdigit() for u, a in texts.FILLER for ch in u + a)


def test_shared_reading_equals_each_policy_alone(model):
    ids = ce.make_trials(model.tokenizer, depths=(0.5,), needles=1, length=700)[0].ids
    configs = [("none", 1.0), ("h2o", 0.25), ("snapkv", 0.25), ("tova", 0.5), ("key-norm", 0.5), ("sinks-window", 0.25)]
    together = {c: (cache.positions(0).clone(), row.clone(), cache.evicted)
                for c, cache, row in ce.branches(model, ids, configs, step=8)}
    for c in configs:
        (_, cache, row), = ce.branches(model, ids, [c], step=8)
        pos, want_row, evicted = together[c]
        assert evicted == cache.evicted and (evicted > 0) == (c[0] != "none")
        assert torch.equal(cache.positions(0), pos)
        torch.testing.assert_close(row, want_row, atol=1e-5, rtol=1e-5)


def test_command_writes_a_table_json_and_plot(folder, tmp_path, attnchat_cli):
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    status, stdout, stderr = attnchat_cli(
        "cache-eval", "--model", str(folder), "--policies", "h2o,tova", "--budgets", "0.5", "--depths", "0.2,0.8",
        "--needles", "1", "--length", "300", "--nll-context", "200", "--nll-tokens", "60", "--json", str(out),
        "--plot", str(png))
    assert status == 0, stderr
    assert "| full cache | - | " in stdout and "| h2o | 50% |" in stdout and "| tova | 50% |" in stdout
    report = json.loads(out.read_text())["reports"][0]
    assert report["full"]["needle_trials"] == 2 and len(report["results"]) == 2
    for res in report["results"]:
        assert 0.45 < res["kv_share"] < 0.6 and res["evicted_tokens"] > 100
        assert res["nll_delta"] == pytest.approx(res["nll"] - report["full"]["nll"])
    assert report["full"]["kv_share"] == 1.0 and report["full"]["evicted_tokens"] == 0
    assert png.stat().st_size > 10_000


def test_command_refuses_bad_options_before_loading(tmp_path, attnchat_cli):
    cases = ((["--budgets", "1.5"], "--budgets"), (["--policies", "lru"], "unknown policy lru"),
             (["--json", str(tmp_path / "no" / "x.json")], "does not exist"))
    for args, words in cases:
        status, _, err = attnchat_cli("cache-eval", "--model", "missing.gguf", *args)
        assert status == 2 and words in err and "Traceback" not in err, (args, err)
