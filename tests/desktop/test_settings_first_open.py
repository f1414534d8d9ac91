"""The Settings dialog's help texts are whole the first time it opens from the window (on X
with openbox, 1100 x 720: "The cache never grows past this; the context is capped at what it
holds." under "KV-cache memory limit" was cut to half its two lines, overlapped by the row below)."""
from __future__ import annotations

import pytest

from desktop.worker import EngineWorker
from tests.desktop.test_daily_driver import _squeezed
from tests.desktop.test_panel_width import sized


@pytest.fixture(scope="module")
def real_model(default_model_file):
    """The default model as the app loads it (its own blocks on the CPU)."""
    import runtime

    return runtime.load_model(default_model_file, device="cpu")


@pytest.mark.parametrize("size", [(1100, 720), (1366, 768)])
def test_the_help_texts_are_whole_when_the_dialog_first_opens(qtbot, make_window, real_model, size):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: real_model))
    sized(qtbot, w, *size)
    d = w.settings_controller.open()
    qtbot.waitExposed(d)
    qtbot.wait(300)
    for i in (*range(d.tabs.count()), 0):
        d.tabs.setCurrentIndex(i)
        qtbot.wait(50)
        tab = d.tabs.widget(i)
        page = tab.widget() if hasattr(tab, "widget") and callable(tab.widget) else tab
        assert _squeezed(page) == [], d.tabs.tabText(i)
    d.reject()
