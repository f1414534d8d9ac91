"""The status bar and the KV-cache panel say the same true thing, on real widgets: one
context limit, the open conversation's figures (not the last one's), a
readable empty chart, a legend no line runs through."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QSizeGrip

from desktop.panels.kv.panel import EMPTY_TOP_BYTES, OTHER_MODEL, KVPanel
from desktop.settings.values import Settings
from desktop.worker import EngineWorker, model_key
from tests.desktop.fakes import fake_load, fake_session_factory

MIB = 2**20


def kv_of(w) -> KVPanel:
    return w.panels["kvCachePanel"].widget()


def test_new_chat_empties_the_panel_as_it_does_the_status_bar(qtbot, make_window):
    w = make_window()
    kv = kv_of(w)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello there")
    first = w.current_conversation
    used = w.store.messages(first)[-1].stats["context_used"]
    assert used > 0
    qtbot.waitUntil(lambda: kv.series.tokens[-1:] == [used], timeout=2000)
    assert w.status.context_label.text() == f"Context {used:,} / 8,192"
    w.new_conversation()
    # A new chat: no tokens in the panel either, as the status bar's 0 says.
    assert kv.series.tokens == [] and "No reply yet in this conversation" in kv.readout.text()
    # and the cache dtype the next reply gets, the one Settings' "auto" names
    assert f"Next reply: {w.engine.model['cache_dtype']} cache, context limit 8,192 tokens" in kv.readout.text()
    assert w.status.context_label.text() == "Context 0 / 8,192" and kv.context_limit() == 8192
    w.open_conversation(first)   # back: both show that conversation's last reply
    assert kv.series.tokens == [used] and f"<b>{used:,}</b> / 8,192 tokens" in kv.readout.text()
    assert w.status.context_label.text() == f"Context {used:,} / 8,192"


def test_one_context_limit_in_the_status_bar_and_the_panel(qtbot, make_window, tmp_path):
    Settings(tmp_path / "settings.ini").set("generation/context", 160)   # saved before the app starts
    w = make_window()
    kv = kv_of(w)
    # It said "Context 0 / 8,192" (the model's maximum) while the panel said 160.
    assert w.status.context_label.text() == "Context 0 / 160"
    assert kv.context_limit() == 160 and kv.context_line.value() == 160
    assert "context limit 160 tokens" in kv.readout.text()
    # A cache memory limit caps both alike: the fake model keeps 2 x 2 layers x 2 KV heads x
    # 8 dims x 4 bytes = 256 bytes per token, so 0.02 MiB (20,971 bytes) holds 81 tokens.
    w.settings.set("generation/cache_limit_mib", 0.02)
    assert w.status.context_label.text() == "Context 0 / 81"
    assert kv.context_limit() == 81 and kv.context_line.value() == 81 and "context limit 81 tokens" in kv.readout.text()
    w.settings.set("generation/cache_limit_mib", 0.0)
    w.settings.set("generation/context", 0)
    assert w.status.context_label.text() == "Context 0 / 8,192" and kv.context_limit() == 8192


def test_a_remote_model_shows_the_open_conversations_reply(qtbot, make_window):
    """Connecting with a conversation open: the panel said "No reply yet." beside its reply."""
    def load(source, device):
        if not source.startswith("http"):
            return fake_load(source, device)
        info = {"name": "srv-model", "path": source, "device": "server 127.0.0.1:37123", "dtype": "",
                "context_limit": 4096, "remote": True}
        return SimpleNamespace(remote=True, info=lambda: dict(info), name="srv-model", path=Path(source))

    w = make_window(worker=EngineWorker(load_fn=load, session_fn=fake_session_factory()))
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello")
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("http://127.0.0.1:37123/v1")
    kv = kv_of(w)
    assert kv.remote and kv.plot.isHidden()
    # The reply came from the local model: its figures are not the server's, and the panel says
    # why it shows none (it said "No reply yet." beside that reply).
    assert "No reply yet" not in kv.readout.text() and OTHER_MODEL in kv.readout.text()
    assert w.status.context_label.text() == "Context 0 / 4,096"
    conv = w.current_conversation
    w.store.add_message(conv, "user", "and again")
    w.store.add_message(conv, "assistant", "yes", stats={"model": model_key(w.engine.model), "completion_tokens": 7,
                                                          "context_used": 40, "context_limit": 4096})
    w.new_conversation()
    w.open_conversation(conv)   # a reply from the server: its figures
    assert "about 7 reply tokens" in kv.readout.text() and w.status.context_label.text() == "Context 40 / 4,096"
    w.new_conversation()
    assert "No reply yet." in kv.readout.text() and w.status.context_label.text() == "Context 0 / 4,096"


def test_the_empty_chart_has_a_readable_axis(qtbot):
    """First run, no model: the y axis ran 1e-07 to 1e-06 MiB."""
    panel = KVPanel()
    qtbot.addWidget(panel)
    panel.redraw()
    assert panel.plot.getPlotItem().viewRange()[1] == [0.0, EMPTY_TOP_BYTES / MIB * 1.08]
    assert EMPTY_TOP_BYTES == MIB and "No model is loaded" in panel.readout.text()
    left = panel.plot.getPlotItem().getAxis("left")
    ticks = [s for level in left.tickValues(0, 1.08, 400) for s in left.tickStrings(level[1], 1, level[0])]
    assert ticks and not any("e-" in t for t in ticks), ticks


def test_the_legend_stays_clear_of_the_lines(qtbot, tmp_path):
    """The allocated line crossed the legend when the cache was near the chart's top (a
    cache allocated for the whole context); the legend now sits under the chart."""
    panel = KVPanel()
    qtbot.addWidget(panel)
    panel.resize(290, 680)
    panel.show()
    panel.on_model({"name": "smol", "device": "cpu", "dtype": "float32", "context_limit": 8192,
                    "n_layers": 30, "n_kv_heads": 3, "head_dim": 64})
    bpt = 46_080
    for t in (10, 40, 44):
        panel.on_stats({"conv_id": 1, "request": 1, "context_limit": 8192,
                        "kv_cache": {"dtype": "float32", "bytes_per_token": bpt, "tokens": t,
                                     "used_bytes": t * bpt, "allocated_bytes": 8192 * bpt}})
    panel.redraw()
    qtbot.wait(50)
    item = panel.plot.getPlotItem()
    legend, view = panel.legend.sceneBoundingRect(), item.vb.sceneBoundingRect()
    assert panel.allocated_curve.getData()[1][-1] == 8192 * bpt / MIB   # the line runs along the top
    assert legend.height() > 0 and not legend.intersects(view), (legend, view)
    assert legend.top() >= item.getAxis("bottom").sceneBoundingRect().bottom() - 1
    shown = panel.plot.mapToScene(panel.plot.rect()).boundingRect()
    assert item.sceneBoundingRect().width() <= shown.width() + 1   # the legend does not widen the chart
    for sample, label in panel.legend.items:   # every entry whole inside the chart's widget
        assert shown.contains(sample.sceneBoundingRect()) and shown.contains(label.sceneBoundingRect()), label.text
    assert [label.text for _, label in panel.legend.items] == ["float32", "bf16 / fp16", "int8 + scales", "allocated", "used"]
    panel.grab().save(str(tmp_path / "kv-legend.png"))
    assert (tmp_path / "kv-legend.png").stat().st_size > 1000


def _message_fits(status, text: str) -> bool:
    """The message fits where Qt draws it: from x 6 to 2 px before the first permanent widget
    shown (a folded one too), and before the size grip."""
    status.layout().activate()
    grips = [g.x() for g in status.findChildren(QSizeGrip) if g.isVisible()]
    right = min([status.width() - 12, *grips, *(w.x() - 2 for w in status.fields() if w.isVisible())])
    return status.fontMetrics().horizontalAdvance(text) <= right - 6


def test_status_messages_are_shown_whole(qtbot, make_window):
    """Connected to a server while serving: "Connected to 127.0.0.1:37" was cut by the fields."""
    w = make_window()
    w.resize(1100, 720)
    qtbot.waitUntil(lambda: w.width() == 1100, timeout=2000)
    st = w.status
    st.model_label.setText("SmolLM2-135M-Instruct.Q4_1")
    st.device_label.setText("server 127.0.0.1:37123")
    st.speed_label.setText("TTFT 0.47 s · 3.6 tok/s")
    st.context_label.setText("Context 199 / 8,192")
    serving = w.serve_toggle.label
    serving.setText("Serving at http://127.0.0.1:37123/v1 (SmolLM2-135M-Instruct.Q4_1) · copy the address")
    serving.show()
    qtbot.wait(20)
    text = "Connected to 127.0.0.1:37123"
    assert not _message_fits(st, text)   # the fields leave it too little room
    st.showMessage(text, 5000)
    qtbot.wait(20)
    assert st.currentMessage() == text and _message_fits(st, text)
    st.clearMessage()
    qtbot.wait(20)
    assert all(f.width() > 0 for f in st.fields() if f.isVisible()) and serving.isVisible()
    # Longer than the whole bar: cut with "…", whole in the tooltip and in the window's notice.
    error = "Could not load the model: " + "the file is not a GGUF model file; " * 12 + "choose another file"
    w.show_error(error)
    qtbot.wait(20)
    assert st.currentMessage().endswith("…") and st.toolTip() == error
    assert _message_fits(st, st.currentMessage())   # the "…" itself is not cut off
    assert w.notice.isVisible() and w.notice.text() == error and w.notice.wordWrap()
    w.status.clearMessage()
    assert st.toolTip() == ""


def test_the_chart_lines_keep_their_width_at_device_pixel_ratio_2(qtbot, monkeypatch):
    """pyqtgraph's pens are cosmetic (device pixels): at a ratio of 2 every line was half as thick."""
    widths = {}
    for ratio in (1.0, 2.0):
        monkeypatch.setattr(KVPanel, "devicePixelRatioF", lambda self, r=ratio: r)
        panel = KVPanel()
        qtbot.addWidget(panel)
        panel.show()
        widths[ratio] = [panel.used_curve.opts["pen"].widthF(), panel.allocated_curve.opts["pen"].widthF(),
                         panel.theory["float32"].opts["pen"].widthF(), panel.context_line.pen.widthF()]
        assert panel.theory["float32"].opts["pen"].style() == Qt.PenStyle.DashLine
    assert widths[1.0] == [3, 2, 1, 1.5] and widths[2.0] == [6, 4, 2, 3]


def test_the_loaded_message_is_whole_after_the_fields_take_the_conversations_figures(qtbot, make_window):
    """After a restart at 1100x720, "Loaded SmolLM2-135M-Instruct.Q4_1 in … s" is shown whole: the
    message is sized after the fields take the open conversation's last-reply figures, not before."""
    def long_name(source, device):
        m = fake_load(source, device)
        m.name = "SmolLM2-135M-Instruct.Q4_1"
        return m

    def worker():
        return EngineWorker(load_fn=long_name, session_fn=fake_session_factory(None, 0.002, None))

    w = make_window(worker=worker())
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello " * 40)
    w.close()
    again = make_window(worker=worker(), load=False)   # a restart: the last conversation opens, then the model loads
    again.resize(1100, 720)
    qtbot.waitUntil(lambda: again.width() == 1100, timeout=2000)
    with qtbot.waitSignal(again.engine.model_loaded, timeout=5000):
        again.load_model("fake.gguf")
    qtbot.wait(50)
    text = again.status.currentMessage()
    assert text.startswith("Loaded ") and text.endswith(" s") and _message_fits(again.status, text), text
