"""The KV-cache figures say what the cache holds now (real worker thread, tiny seeded random
models): after another model loads (a fresh cache, that model's shape and limits, in the
panel and the status bar alike) and after an edit crops the cache."""
from __future__ import annotations

import math

import pytest
from PySide6.QtGui import QColor

from desktop.panels.kv.panel import COLORS, OTHER_MODEL
from desktop.worker import EngineWorker


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two models of different shapes: 2 layers x 2 KV heads x 16 dims (512 bytes per token in
    float32, 1,024 positions) and x 4 KV heads (1,024 bytes per token, 512 positions)."""
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    a = make_tiny_model(tmp_path_factory.mktemp("a"), "llama", max_positions=1024)
    b = make_tiny_model(tmp_path_factory.mktemp("b"), "llama", max_positions=512, overrides={"num_key_value_heads": 4})
    return {"a.gguf": load_model(a, device="cpu", dtype="float32"), "b.gguf": load_model(b, device="cpu", dtype="float32")}


def send(qtbot, w, text):
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.submit(text)
    return done.args[0]


def used_dot_pixels(kv) -> int:
    """Pixels of the "used" colour inside the chart's plotting area (the legend is outside it)."""
    kv.redraw()
    image = kv.plot.grab().toImage()
    area = kv.plot.mapFromScene(kv.plot.getPlotItem().vb.sceneBoundingRect()).boundingRect()
    want = QColor(COLORS["used"])
    ratio = image.devicePixelRatio()
    hits = 0
    for x in range(int(area.left() * ratio), int(area.right() * ratio), 1):
        for y in range(int(area.top() * ratio), int(area.bottom() * ratio), 1):
            c = image.pixelColor(x, y)
            hits += abs(c.red() - want.red()) < 30 and abs(c.green() - want.green()) < 30 and abs(c.blue() - want.blue()) < 30
    return hits


def test_another_model_shows_its_own_figures_from_the_moment_it_loads(qtbot, make_window, tiny_pair):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny_pair[source]), load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=10_000):
        w.load_model("a.gguf")
    w.generation_overrides = {"max_new_tokens": 8, "temperature": 0.0}
    w.panels["kvCachePanel"].raise_()
    kv = w.panels["kvCachePanel"].widget()
    first = send(qtbot, w, "the cat sat")
    used = first["stats"]["context_used"]
    assert first["stats"]["kv_cache"]["bytes_per_token"] == 512 and first["stats"]["model"] == str(tiny_pair["a.gguf"].path)
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [used], timeout=2000)
    assert w.status.context_label.text() == f"Context {used:,} / 1,024" and used_dot_pixels(kv) > 0

    with qtbot.waitSignal(w.engine.model_loaded, timeout=10_000):
        w.load_model("b.gguf")
    # Before any message: an empty cache with the new model's shape and limit, everywhere.
    assert w.context_limit() == 512
    assert w.status.context_label.text() == "Context 0 / 512" and w.status.speed_label.text() == ""
    assert kv.series.tokens == [] and kv.context_limit() == 512 and kv.context_line.value() == 512
    text = kv.readout.text()
    assert OTHER_MODEL in text and "1,024 bytes per token in float32" in text and "512 bytes" not in text
    assert list(kv.now_dot.getData()[0] or []) == [] and used_dot_pixels(kv) == 0   # the old dot is gone
    # Another conversation and back: still nothing from the other model.
    conv = w.current_conversation
    w.new_conversation()
    w.open_conversation(conv)
    assert w.status.context_label.text() == "Context 0 / 512" and OTHER_MODEL in kv.readout.text()

    second = send(qtbot, w, "and the dog")
    assert second["stats"]["kv_cache"]["bytes_per_token"] == 1024
    assert second["stats"]["reused_tokens"] == 0   # a new model reads the conversation from the start
    now = second["stats"]["context_used"]
    qtbot.waitUntil(lambda: f"<b>{now:,}</b>" in kv.readout.text(), timeout=2000)
    assert w.status.context_label.text() == f"Context {now:,} / 512" and "1,024 bytes per token (float32)" in kv.readout.text()
    w.new_conversation()
    w.open_conversation(conv)   # this model's reply: its figures
    assert w.status.context_label.text() == f"Context {now:,} / 512" and kv.series.tokens == [now]
    with qtbot.waitSignal(w.engine.model_loaded, timeout=10_000):
        w.load_model("a.gguf")   # back to the first model: the last reply is the other one's
    assert w.status.context_label.text() == "Context 0 / 1,024" and OTHER_MODEL in kv.readout.text()


def test_after_an_edit_the_used_line_ends_at_what_the_cache_holds(qtbot, make_window, tiny_pair):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny_pair[source]), load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=10_000):
        w.load_model("a.gguf")
    w.generation_overrides = {"max_new_tokens": 24, "temperature": 0.0}
    kv = w.panels["kvCachePanel"].widget()
    send(qtbot, w, "the cat sat on the mat and the dog")
    longest = send(qtbot, w, "or a bird in the tree")["stats"]["context_used"]
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [longest], timeout=2000)
    w.edit_message(0)
    w.input.setPlainText("a cat")
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.input.submit()
    stats = done.args[0]["stats"]
    now = stats["context_used"]
    assert now < longest and 0 < stats["reused_tokens"] < now   # the cache was cropped to the shared prefix
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [now], timeout=2000)
    kv.redraw()
    xs, used, _ = kv.plotted()
    assert max(xs) == now and not any(math.isnan(x) for x in xs)   # no line left past the cache's end
    assert all(b <= a for a, b in zip(xs[1:], xs[:-1]))
    assert "<b>{:,}</b>".format(now) in kv.readout.text()
