"""Explain over what the KV cache held: after rolling overflow the model predicted the newest
reply token from the sinks and the newest window, so Explain reads that context (the tokens the
cache had dropped are left out and said), with each token labelled by its conversation position."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import runtime
from desktop.panels.attention.insight.explain import ExplainView
from desktop.panels.attention.insight.probe import InsightProbe

HISTORY = [("user", "the cat sat on the mat"), ("assistant", "and the dog sat on the rug"),
           ("user", "where did the cat sit"), ("assistant", "on the mat by the door")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    return runtime.load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def run_explain(qtbot, tiny, held):
    ap = SimpleNamespace(_model=lambda: tiny, held_ids=lambda conv_id, model: list(held),
                         _tokens=lambda model, ids: [f"<{i}>" for i in ids])
    probe = InsightProbe(ap)
    got, failed = [], []
    probe.explain_ready.connect(got.append)
    probe.failed.connect(lambda r, msg: failed.append(msg))
    probe.explain(1, 7, HISTORY, "", 1, 0, -1, 5, 2, 4)
    assert not failed and len(got) == 1
    return got[0]


def test_explain_reads_the_context_the_cache_held(qtbot, tiny):
    ids, reply = runtime.reply_positions(tiny, [runtime.Message(r, c) for r, c in HISTORY])
    t = reply[-1]
    held = ids[:4] + ids[t - 9:t + 1]            # rolling: 4 sinks, then the newest window
    r = run_explain(qtbot, tiny, held)
    assert r["position"] == t and r["positions"] == [0, 1, 2, 3, *range(t - 9, t)]
    assert r["dropped"] == t - 13 > 0 and len(r["attention"]) == 13
    view = ExplainView()
    qtbot.addWidget(view)
    view.set_result(r)
    labels = {view.table.item(i, 0).text().split()[0] for i in range(view.table.rowCount())}
    assert labels == {f"#{p}" for p in r["positions"]}   # conversation positions, not 0..12
    assert f"{t - 13} earlier tokens had been dropped" in view.summary.text()
    # Nothing dropped: the whole conversation, and nothing said.
    whole = run_explain(qtbot, tiny, ids[:t + 1])
    assert whole["positions"] == list(range(t)) and whole["dropped"] == 0
    view.set_result(whole)
    assert "dropped" not in view.summary.text()
