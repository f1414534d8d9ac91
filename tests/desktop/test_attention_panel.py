"""The attention panel: pooling and masking, a 2,048-token snapshot that never stalls the
event loop, hover read-outs, live capture only while the panel is open (on a tiny real
model through the real worker thread), snapshot, head atlas, formula and export."""
from __future__ import annotations

import time

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, Qt, QTimer
from PySide6.QtTest import QTest

from desktop.panels.attention.panel import ATLAS, LIVE, NUMBERS, PANEL_NAME, SNAPSHOT
from desktop.panels.attention.probe import LIVE_INTERVAL_S, AttentionProbe
from desktop.panels.attention.views import entropy_bits, prepare_matrix
from desktop.panels.attention.heatmap import causal_mask, colorize, max_pool
from desktop.worker import EngineWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny seeded llama (2 layers, 4 heads, 2 KV heads, 128 positions) loaded by our runtime."""
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def causal_rows(T: int, seed: int = 0) -> np.ndarray:
    """A random causal attention matrix (T, T): rows sum to 1, zero above the diagonal."""
    rng = np.random.default_rng(seed)
    m = np.tril(rng.random((T, T), dtype=np.float32) ** 8)
    return m / m.sum(axis=1, keepdims=True)


def panel_of(window):
    return window.panels[PANEL_NAME].widget()


def open_panel(qtbot, window, tab: int):
    dock = window.panels[PANEL_NAME]
    dock.toggleViewAction().trigger()   # View > Attention: shown, and raised over the KV tab
    panel = dock.widget()
    panel.tabs.setCurrentIndex(tab)
    qtbot.waitUntil(panel.isVisible, timeout=2000)
    return panel


def send_and_wait(qtbot, window, text: str, timeout: int = 20_000):
    with qtbot.waitSignal(window.reply_finished, timeout=timeout) as done:
        window.submit(text)
    return done.args[0]


# ---- pure numpy: pooling, masking, colours ---------------------------------------------------
def test_max_pooling_keeps_one_pixel_stripes_and_the_mask():
    m = np.zeros((2048, 2048), dtype=np.float32)
    m[:, 777] = 0.9          # every query looks at one token: a one-token stripe
    m[1500, :1500] = 0.5     # one query row
    m = np.tril(m)
    pooled = max_pool(m, 300, 300)
    assert pooled.shape == (300, 300)
    stripe = int(777 / 2048 * 300)
    assert pooled[-1, stripe] == pytest.approx(0.9) and np.all(pooled[stripe + 1 :, stripe] == pytest.approx(0.9))
    rows_with_it = np.flatnonzero((pooled == 0.5).any(axis=1))
    assert rows_with_it.tolist() == [int(1500 / 2048 * 300)]   # the one row survives too
    mask = causal_mask(2048, 2048, 300, 300)
    assert mask[0, -1] and not mask[-1, 0] and not mask.diagonal().any()  # blocks on the diagonal are shown
    pooled[mask] = np.nan
    rgba = colorize(pooled, 1.0, masked=(1, 2, 3))
    assert rgba.shape == (300, 300, 4) and tuple(rgba[0, -1, :3]) == (1, 2, 3)
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(max_pool(small, 10, 10), small) and max_pool(small, 10, 10) is not small  # never up-sampled, never aliased
    assert causal_mask(3, 3, 3, 3).tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_snapshot_options_hide_the_sink_and_renormalise_rows():
    m = causal_rows(50)
    shown = prepare_matrix(m, hide_first=True, renormalise=True)
    assert shown.shape == (50, 49)
    assert not shown[0].any()                               # query 0 sees only the hidden token
    np.testing.assert_allclose(shown[1:].sum(axis=1), 1.0, rtol=1e-5)
    assert causal_mask(50, 49, 50, 49, offset=1)[3].tolist() == [False] * 3 + [True] * 46  # keys 1..3 of query 3
    assert prepare_matrix(m) is not None and np.array_equal(prepare_matrix(m), m)
    assert entropy_bits(np.eye(4, dtype=np.float32)).tolist() == [0, 0, 0, 0]
    assert entropy_bits(np.full((1, 8), 1 / 8)) == pytest.approx(3.0)


# ---- the GUI on the fake engine ---------------------------------------------------------------
def test_capture_is_on_only_while_the_live_tab_is_on_screen(qtbot, make_window):
    w = make_window()
    dock = w.panels[PANEL_NAME]
    probe = panel_of(w).client.probe
    assert not dock.isVisible() and not probe.active            # closed by default
    assert dock.toggleViewAction() in w.view_menu.actions()
    panel = open_panel(qtbot, w, LIVE)
    assert probe.active
    others = w.tabifiedDockWidgets(dock)                         # it shares the right area as a tab
    if others:
        others[0].raise_()
        qtbot.waitUntil(lambda: not probe.active, timeout=2000)   # behind another tab: off
        dock.raise_()
        qtbot.waitUntil(lambda: probe.active, timeout=2000)
    panel.tabs.setCurrentIndex(SNAPSHOT)
    assert not probe.active
    panel.tabs.setCurrentIndex(LIVE)
    assert probe.active
    dock.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: not probe.active, timeout=2000)


def test_a_2048_token_snapshot_renders_without_stalling_the_event_loop(qtbot, make_window):
    w = make_window()
    w.resize(1100, 720)
    panel = open_panel(qtbot, w, SNAPSHOT)
    T = 2048
    snap = {"request": 0, "conv_id": 1, "layer": 3, "head": 5, "matrix": causal_rows(T),
            "tokens": [f"t{i}" for i in range(T)], "offset": 0, "total": T}
    gaps, last = [], [time.thread_time()]  # the GUI thread's CPU time: descheduling does not count

    def tick():
        now = time.thread_time()
        gaps.append(now - last[0])
        last[0] = now

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(10)
    qtbot.wait(50)
    view, heat = panel.snapshot, panel.snapshot.heat
    t0 = time.perf_counter()
    view.set_snapshot(snap)
    qtbot.waitUntil(lambda: view.snap is snap and heat.ready(), timeout=10_000)
    view.hide_first.setChecked(True)
    qtbot.waitUntil(lambda: view.shown.shape == (T, T - 1) and heat.ready(), timeout=10_000)
    view.renormalise.setChecked(True)
    qtbot.waitUntil(lambda: view.data()["renormalise"] and heat.ready(), timeout=10_000)
    w.resize(1000, 700)
    qtbot.wait(20)
    qtbot.waitUntil(heat.ready, timeout=10_000)
    elapsed = time.perf_counter() - t0
    timer.stop()
    img = heat.image()
    assert img is not None and img.width() <= heat.width() * heat.devicePixelRatioF() < T
    np.testing.assert_allclose(view.shown[1:].sum(1), 1.0, rtol=1e-4)
    assert max(gaps) < 0.1, f"the event loop stalled for {max(gaps) * 1000:.0f} ms (render took {elapsed:.2f} s)"


def test_snapshot_hover_shows_query_key_and_weight_and_the_masked_triangle(qtbot, make_window):
    w = make_window()
    panel = open_panel(qtbot, w, SNAPSHOT)
    m = causal_rows(6, seed=3)
    panel.snapshot.set_snapshot({"request": 0, "conv_id": 1, "layer": 0, "head": 1, "matrix": m,
                                 "tokens": ["<s>", " the", " cat", " sat", " on", "\n"], "offset": 0, "total": 6})
    heat = panel.snapshot.heat
    qtbot.waitUntil(lambda: heat.image() is not None)
    r = heat.plot_rect()

    def centre(i, j):
        return QPointF(r.left() + (j + 0.5) * r.width() / 6, r.top() + (i + 0.5) * r.height() / 6)

    assert heat.cell_at(centre(4, 2)) == (4, 2)
    QTest.mouseMove(heat, centre(4, 2).toPoint())
    text = panel.snapshot.readout.text()
    assert "#4" in text and "on" in text and "#2" in text and "cat" in text and f"{m[4, 2]:.4f}" in text
    QTest.mouseMove(heat, centre(1, 4).toPoint())
    assert "masked" in panel.snapshot.readout.text()
    QTest.mouseClick(heat, Qt.MouseButton.LeftButton, pos=centre(5, 0).toPoint())   # a row: its query
    assert panel.numbers.query.value() == 5


# ---- live capture on a real (tiny) model, through the real worker thread ----------------------
def test_live_attention_only_while_the_panel_is_open(qtbot, make_window, tiny, monkeypatch):
    seen = []   # the decoder's observer at every forward
    real = tiny.decoder.forward

    def spy(*a, **k):
        seen.append(tiny.decoder.observer)
        return real(*a, **k)

    monkeypatch.setattr(tiny.decoder, "forward", spy)
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 12, "temperature": 0.0}
    panel = panel_of(w)
    frames = []
    panel.client.live.connect(frames.append)

    send_and_wait(qtbot, w, "the cat")                    # panel closed
    assert seen and all(o is None for o in seen) and not frames

    open_panel(qtbot, w, LIVE)
    assert panel.client.probe.active
    seen.clear()
    t0 = time.perf_counter()
    send_and_wait(qtbot, w, "and the dog")
    elapsed = time.perf_counter() - t0
    qtbot.waitUntil(lambda: frames and frames[-1]["final"], timeout=5000)
    assert seen and all(o is not None for o in seen)      # captured from the first prefill chunk on
    assert tiny.decoder.observer is None                  # removed when the reply ended
    assert len(frames) <= elapsed / LIVE_INTERVAL_S + 2   # at most ~10 frames a second
    last = frames[-1]
    L, H = tiny.config.n_layers, tiny.config.n_heads
    assert last["weights"].shape == (L, H, len(last["tokens"])) and last["weights"].dtype == np.float32
    np.testing.assert_allclose(last["weights"].sum(-1), 1.0, rtol=1e-5)
    # The live rows are the attention of the newest token over what the cache holds.
    from runtime import LayerAttention

    ids = panel.client.probe.last_context(w.current_conversation)
    assert len(ids) == len(last["tokens"])
    for layer in range(L):
        la = LayerAttention(tiny, ids, layer)
        for h in range(H):
            np.testing.assert_allclose(last["weights"][layer, h], la.matrix(h)[-1].numpy(), atol=2e-5)
    assert "Newest token" in panel.live.caption.text() and panel.live.text.tokens == last["tokens"]

    w.panels[PANEL_NAME].close()                          # closed: no capture at all
    qtbot.waitUntil(lambda: not panel.client.probe.active, timeout=2000)
    seen.clear()
    frames.clear()
    send_and_wait(qtbot, w, "one more")
    assert seen and all(o is None for o in seen) and not frames
    assert tiny.decoder.observer is None


def test_hiding_mid_reply_removes_the_observer_at_the_next_step(tiny):
    """The wrap reads the flag before every event: hidden, the next forward runs without capture."""
    from runtime import ChatSession, GenerationSettings, SamplingParams

    class Stub:
        model = tiny
        live_attention = None

    probe = AttentionProbe(Stub())
    probe.set_active(True)
    s = ChatSession(tiny, settings=GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=20,
                                                      context_limit=128))
    events = probe.wrap(1, s, s.send("the"))
    observers = []
    for i, _ev in enumerate(events):
        observers.append(tiny.decoder.observer)
        if i == 3:
            probe.set_active(False)
    assert observers[1] is not None and all(o is None for o in observers[4:])
    assert tiny.decoder.observer is None and probe.last_context(1)


def test_a_reply_whose_every_step_sent_a_frame_still_sends_the_final_one(tiny, monkeypatch):
    """When each step takes longer than the live interval (a busy machine), every step's
    frame goes out; the Finish must still send one marked final (the panel waits for it)."""
    from desktop.panels.attention import probe as probe_mod
    from runtime import ChatSession, GenerationSettings, SamplingParams

    monkeypatch.setattr(probe_mod, "LIVE_INTERVAL_S", 0.0)

    class Stub:
        model = tiny
        live_attention = None

    probe = AttentionProbe(Stub())
    frames = []
    probe.live.connect(frames.append)
    probe.set_active(True)
    s = ChatSession(tiny, settings=GenerationSettings(sampling=SamplingParams(temperature=0.0), max_new_tokens=5,
                                                      context_limit=128))
    list(probe.wrap(1, s, s.send("the")))
    assert len(frames) >= 2 and [f["final"] for f in frames].count(True) == 1 and frames[-1]["final"]
    assert len(frames[-1]["tokens"]) == len(probe.last_context(1))


def test_snapshot_atlas_formula_and_export_through_the_worker(qtbot, make_window, tiny, tmp_path):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 6, "temperature": 0.0}
    send_and_wait(qtbot, w, "the cat sat")
    panel = open_panel(qtbot, w, LIVE)
    c = panel.client
    panel.select(1, 2)
    with qtbot.waitSignal(c.snapshot_ready, timeout=10_000) as got:
        panel.tabs.setCurrentIndex(SNAPSHOT)
    snap = got.args[0]
    T = len(snap["tokens"])
    assert snap["layer"] == 1 and snap["head"] == 2 and snap["matrix"].shape == (T, T) and T > 5
    np.testing.assert_allclose(snap["matrix"].sum(1), 1.0, rtol=1e-5)
    qtbot.waitUntil(lambda: panel.snapshot.snap is not None)
    qtbot.wait(50)   # drawn: the data the engine sent is never written to
    np.testing.assert_allclose(snap["matrix"].sum(1), 1.0, rtol=1e-5)
    assert "Layer 1 · head 2" in panel.snapshot.caption.text()

    with qtbot.waitSignal(c.atlas_ready, timeout=20_000) as got:
        panel.tabs.setCurrentIndex(ATLAS)
    atlas = got.args[0]
    assert atlas["induction"].shape == (2, 4) and atlas["previous_token"].shape == (2, 4)
    qtbot.waitUntil(lambda: panel.atlas.top.count() == 10)
    grid = panel.atlas.grids["induction"]
    r = grid.plot_rect()
    QTest.mouseClick(grid, Qt.MouseButton.LeftButton,
                     pos=QPoint(int(r.left() + 3.5 * r.width() / 4), int(r.top() + 0.5 * r.height() / 2)))
    assert (panel.selected_layer, panel.selected_head) == (0, 3)

    panel.numbers.query.setValue(T - 2)
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.tabs.setCurrentIndex(NUMBERS)
    steps = got.args[0]
    assert steps["layer"] == 0 and steps["head"] == 3 and steps["query"] == T - 2 and len(steps["keys"]) == 5
    qtbot.waitUntil(lambda: panel.numbers.table.rowCount() == 5)
    assert "softmax" in panel.numbers.explanation.text()

    for tab, name in ((SNAPSHOT, "snapshot"), (ATLAS, "atlas"), (NUMBERS, "numbers")):
        panel.tabs.setCurrentIndex(tab)
        panel.export_png(tmp_path / f"{name}.png")
        panel.export_npz(tmp_path / f"{name}.npz")
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        data = np.load(tmp_path / f"{name}.npz")
        assert str(data["view"]) == name
    assert np.load(tmp_path / "snapshot.npz")["matrix"].shape == (T, T)
    assert np.load(tmp_path / "atlas.npz")["induction"].shape == (2, 4)
    assert np.load(tmp_path / "numbers.npz")["weights"].shape == (5,)
