"""Figures that go stale: after a restart or a change of the cache settings no cache of the
conversation exists, so the status bar and the KV panel show the limit the next reply gets
and give the old figures as the last reply's; while a long prompt is read, both move."""
from __future__ import annotations

import threading
import time

from desktop.worker import EngineWorker
from runtime import Finish, PrefillProgress, TextPiece, TurnStats
from tests.desktop.fakes import FakeSession, fake_load, fake_session_factory

MIB = 2**20


def kv_of(w):
    return w.panels["kvCachePanel"].widget()


def reply(qtbot, w, text):
    with qtbot.waitSignal(w.reply_finished, timeout=5000) as done:
        w.submit(text)
    return done.args[0]


def test_after_a_restart_the_old_figures_are_the_last_replys_and_the_limit_is_the_settings(qtbot, make_window, tmp_path):
    w = make_window()
    used = reply(qtbot, w, "hello there")["stats"]["context_used"]
    conv = w.current_conversation
    assert used > 0 and w.status.context_label.text() == f"Context {used:,} / 8,192"
    w.close()
    # Between runs the user chose an int8 cache and an 856-token context.
    w.settings.set("generation/cache_dtype", "int8")
    w.settings.set("generation/context", 856)
    w.settings.sync()

    again = make_window()   # the same database and settings: the app started again
    assert again.current_conversation == conv
    kv = kv_of(again)
    # It said "Context 28 / 8,192" and the panel drew a cache that does not exist.
    assert again.status.context_label.text() == f"Context 0 / 856 (last reply {used:,})"
    assert "No KV cache for this conversation yet" in again.status.context_label.toolTip()
    assert again.status.speed_label.text().startswith("Last reply: TTFT")
    assert kv.series.tokens == [] and kv.series.now() is None
    assert kv.context_limit() == 856 and kv.context_line.value() == 856
    text = kv.readout.text()
    assert "No KV cache for this conversation yet" in text and f"{used:,} tokens of 8,192" in text
    assert "Next reply: int8 cache, context limit 856 tokens" in text
    kv.grab().save(str(tmp_path / "kv-after-restart.png"))
    # The next reply makes the cache: its figures are the cache's again.
    used2 = reply(qtbot, again, "and again")["stats"]["context_used"]
    assert again.status.context_label.text() == f"Context {used2:,} / 8,192"   # the fake keeps its own limit
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [used2], timeout=2000)
    qtbot.waitUntil(lambda: f"<b>{used2:,}</b> / 8,192 tokens" in kv.readout.text(), timeout=2000)   # redrawn
    assert "No KV cache" not in kv.readout.text()


def test_a_change_of_the_cache_settings_makes_the_figures_the_last_replys(qtbot, make_window):
    w = make_window()
    used = reply(qtbot, w, "hello there")["stats"]["context_used"]
    kv = kv_of(w)
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [used], timeout=2000)
    w.settings.set("generation/temperature", 0.7)   # not a cache setting: the cache stays
    assert w.status.context_label.text() == f"Context {used:,} / 8,192" and kv.series.tokens == [used]
    w.settings.set("generation/context", 300)       # the worker builds a new cache at the next reply
    assert w.status.context_label.text() == f"Context 0 / 300 (last reply {used:,})"
    assert kv.series.tokens == [] and kv.context_limit() == 300
    assert "Next reply: float32 cache, context limit 300 tokens" in kv.readout.text()
    w.settings.set("generation/context", 0)         # back as it was: that cache is the one the worker holds
    assert w.status.context_label.text() == f"Context {used:,} / 8,192" and kv.series.tokens == [used]


class Cache:
    """A cache whose figures the fake session below fills as it reads the prompt."""

    def __init__(self):
        self.tokens = 0

    def stats(self) -> dict:
        return {"dtype": "float32", "bytes_per_token": 256, "tokens": self.tokens, "used_bytes": 256 * self.tokens,
                "allocated_bytes": 256 * ((self.tokens + 255) // 256 * 256), "limit_bytes": None}


class SlowPrefillSession(FakeSession):
    """Reads a 1,000-token prompt in 4 chunks of 250, 0.15 s each, then writes "ok"."""

    reading = threading.Event()   # set while the third chunk is being read
    go_on = threading.Event()

    def __init__(self, settings):
        super().__init__(settings)
        self.cache = Cache()
        self.context_limit = 8192

    def _generate(self):
        total = 1000
        yield PrefillProgress(0, total)
        for done in range(250, total + 1, 250):
            time.sleep(0.15)
            self.cache.tokens = done
            if done == 500:
                SlowPrefillSession.reading.set()
                SlowPrefillSession.go_on.wait(5)
            yield PrefillProgress(done, total)
        stats = TurnStats(prompt_tokens=total, prefilled_tokens=total, completion_tokens=1, context_limit=8192,
                          kv_cache=self.cache.stats() | {"tokens": total + 1})
        yield TextPiece("ok")
        yield Finish("stop", "ok", stats)


def test_the_kv_panel_and_status_bar_move_while_a_long_prompt_is_read(qtbot, make_window, tmp_path):
    worker = EngineWorker(load_fn=fake_load, session_fn=lambda model, system, settings: SlowPrefillSession(settings))
    w = make_window(worker=worker)
    kv = kv_of(w)
    seen: list[dict] = []
    w.stats_updated.connect(lambda s: seen.append(s))
    SlowPrefillSession.reading.clear()
    SlowPrefillSession.go_on.clear()
    w.submit("a long paste " * 300)
    try:
        # Mid-prompt (after 500 of 1,000 tokens, no reply text yet), the panel said "No reply yet".
        qtbot.waitUntil(lambda: any((s.get("prefill") or {}).get("done") == 250 for s in seen), timeout=5000)
        qtbot.waitUntil(lambda: kv.series.now() is not None and kv.series.now()[0] == 250, timeout=2000)
        kv.redraw()
        assert "Reading the prompt: 250 of 1,000 tokens (25%)." in kv.readout.text()
        assert "<b>250</b> / 8,192 tokens" in kv.readout.text() and "No reply yet" not in kv.readout.text()
        assert w.status.context_label.text() == "Context 250 / 8,192"
        xs, used, _ = kv.plotted()
        assert xs[-1] == 250 and used[-1] == 250 * 256 / MIB
        kv.grab().save(str(tmp_path / "kv-prefill.png"))
    finally:
        SlowPrefillSession.go_on.set()
    qtbot.waitUntil(lambda: w.replies.reply is None, timeout=5000)
    # The reply's own stats replace the prompt's progress.
    assert kv.series.pending == [] and kv.series.prefill is None and kv.series.tokens[-1] == 1001
    assert w.status.context_label.text() == "Context 1,001 / 8,192"


def test_the_worker_reports_a_real_cache_while_it_reads_a_prompt(qtbot, tmp_path_factory):
    """The worker's prefill figures are the session's cache (a tiny real model, prefill in chunks)."""
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model
    from desktop.worker import Engine

    tiny = load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=512),
                      device="cpu", dtype="float32")
    engine = Engine(EngineWorker(load_fn=lambda source, device: tiny, batch_ms=0))
    seen: list[dict] = []
    engine.stats.connect(lambda s: seen.append(s))
    try:
        with qtbot.waitSignal(engine.model_loaded, timeout=10_000):
            engine.load("tiny")
        with qtbot.waitSignal(engine.finished, timeout=60_000):
            engine.send(1, [], "the cat sat on the mat " * 40, {"max_new_tokens": 2, "temperature": 0.0})
    finally:
        engine.shutdown()
    prefill = [s for s in seen if s.get("prefill")]
    assert prefill, "no figures while the prompt was read"
    last = prefill[-1]
    assert last["prefill"]["done"] == last["prefill"]["total"] > 0
    assert last["kv_cache"]["tokens"] == last["context_used"] == last["prefill"]["total"]   # nothing reused: a new chat
    assert last["kv_cache"]["bytes_per_token"] == seen[-1]["kv_cache"]["bytes_per_token"]
    assert last["context_limit"] == seen[-1]["context_limit"] and last["request"] == seen[-1]["request"]


def test_another_model_clears_knock_out_and_explain(qtbot, make_window):
    """Knock-out kept SmolLM2's heads and results after switching to Gemma."""
    w = make_window()
    panel = w.panels["attentionPanel"].widget()
    ko, ex = panel.insight.tabs.knockout, panel.insight.tabs.explain
    ko.heads.setText("17.3 18.6")
    ko.set_result({"before": {"prob": 0.5, "top": [("a", 0.5)]}, "after": {"prob": 0.1, "top": [("b", 0.3)]},
                   "heads": [(17, 3)], "mode": "zero", "position": 4, "token": "a"})
    ex.result = {"attention": [1.0]}
    ex.table.setRowCount(3)
    panel.insight._pending["knockout"] = 99
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("/models/gemma.gguf")
    assert ko.heads.text() == "" and ko.result is None and ko.table.rowCount() == 0
    assert ko.summary.text() == ko.INTRO
    assert ex.result is None and ex.table.rowCount() == 0 and ex.summary.text() == ex.INTRO
    assert panel.insight._pending == {}   # an answer about the old model is not shown
    # The same model loaded again (a reload for another device) keeps them.
    ko.heads.setText("1.0")
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("/models/gemma.gguf")
    assert ko.heads.text() == "1.0"


def test_the_heads_tab_drops_the_old_models_scores_when_another_is_loaded(qtbot, make_window):
    """After a switch it kept SmolLM2's 30 x 9 maps, captioned with SmolLM2's name, until Gemma's came."""
    import numpy as np

    from desktop.panels.attention.panel import PANEL_NAME

    w = make_window()
    atlas = w.panels[PANEL_NAME].widget().atlas
    rng = np.random.default_rng(0)
    atlas.set_scores({"model": "old-model", "batch": 4, "repeat_len": 50, "windows": None,
                      "induction": rng.random((2, 4)), "previous_token": rng.random((2, 4))})
    assert atlas.top.count() == 10 and atlas.caption.text().startswith("old-model: mean attention")
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("other.gguf")
    assert atlas.scores is None and atlas.top.count() == 0 and atlas.top_heads("induction", 5) == []
    assert all(g.values is None for g in atlas.grids.values())
    assert "old-model" not in atlas.caption.text() and atlas.caption.text() == atlas.CAPTION
