"""While a reply streams, the KV panel's figures in words are the status bar's at every update:
the readout waited for the chart's next redraw (every 125 ms, later while the window was busy
drawing the reply), and on X the panel said 217 tokens while the status bar said 221."""
from __future__ import annotations

import re

import pytest

from desktop.worker import EngineWorker
from tests.desktop.test_panel_truth import kv_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def test_the_readout_says_the_status_bars_tokens_at_every_stats_update(qtbot, make_window, tiny):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 40, "temperature": 0.0}
    kv = kv_of(w)
    seen = []

    def check(stats):
        if stats.get("prefill"):
            return
        used = re.search(r"Context ([\d,]+) /", w.status.context_label.text())
        shown = re.search(r"<b>([\d,]+)</b>", kv.readout.text())
        seen.append((used and used.group(1), shown and shown.group(1)))

    w.engine.stats.connect(check)   # after the window's own handlers: both have had this update
    with qtbot.waitSignal(w.reply_finished, timeout=10_000):
        w.submit("hello")
    assert len(seen) > 5
    assert all(a == b for a, b in seen), [p for p in seen if p[0] != p[1]][:5]
