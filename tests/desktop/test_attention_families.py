"""The attention panel on a sliding-window model: a tiny seeded Gemma 3 (two sliding layers
with an 8-token window, one global; one KV head; no chat template, as Gemma 3 270M comes)
through the real worker thread. The snapshot of a sliding layer is a band, the keys out
of the window drawn masked and named so; the head atlas scores its 3 x 4 heads, the
sliding layers (which cannot see one copy back) none for induction, and says why."""
from __future__ import annotations

import numpy as np
import pytest

from desktop.panels.attention.panel import ATLAS, LIVE, SNAPSHOT
from desktop.worker import EngineWorker
from tests.desktop.test_attention_panel import open_panel, send_and_wait
from tests.runtime.tiny_models import WINDOW


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    m = load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "gemma3"), device="cpu", dtype="float32")
    m.tokenizer.chat_template = None
    return m


def test_snapshot_band_and_atlas_of_a_sliding_window_model(qtbot, make_window, gemma, tmp_path):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: gemma))
    w.generation_overrides = {"max_new_tokens": 6, "temperature": 0.0}
    send_and_wait(qtbot, w, "the cat and the dog were very happy")
    panel = open_panel(qtbot, w, LIVE)
    c = panel.client
    panel.select(0, 1)  # layer 0 slides
    with qtbot.waitSignal(c.snapshot_ready, timeout=10_000) as got:
        panel.tabs.setCurrentIndex(SNAPSHOT)
    m = got.args[0]["matrix"]
    T = m.shape[0]
    assert m.shape == (T, T) and T > 2 * WINDOW
    rows, cols = np.indices((T, T))
    inside = (cols <= rows) & (cols > rows - WINDOW)
    assert (m[~inside] == 0).all() and (m[inside] > 0).all()  # a band WINDOW wide
    np.testing.assert_allclose(m.sum(1), 1.0, rtol=1e-5)
    assert got.args[0]["window"] == WINDOW
    qtbot.waitUntil(lambda: panel.snapshot.snap is not None)
    shown = panel.snapshot.shown  # drawn: out of the window masked (grey), like the causal triangle
    assert np.isnan(shown[(cols <= rows - WINDOW)]).all() and not np.isnan(shown[inside]).any()
    assert f"each token sees the {WINDOW} newest" in panel.snapshot.caption.text()
    panel.snapshot._hover(T - 1, 0)
    assert f"out of this layer's {WINDOW}-token window" in panel.snapshot.readout.text()
    qtbot.wait(50)  # the layout settles around the longer caption
    panel.export_png(tmp_path / "band.png")

    with qtbot.waitSignal(c.atlas_ready, timeout=20_000) as got:
        panel.tabs.setCurrentIndex(ATLAS)
    atlas = got.args[0]
    assert atlas["induction"].shape == atlas["previous_token"].shape == (3, 4)
    assert (atlas["induction"][:2] == 0).all() and (atlas["induction"][2] > 0).all()
    assert (atlas["previous_token"] > 0).all()
    qtbot.waitUntil(lambda: panel.atlas.top.count() == 10)
    assert "Layers 0–1 slide with a window shorter than one copy" in panel.atlas.caption.text()
    qtbot.wait(50)
    panel.export_png(tmp_path / "atlas.png")
    assert (tmp_path / "band.png").stat().st_size > 1000 and (tmp_path / "atlas.png").stat().st_size > 1000
