"""The default model is installed before the first start (``make run`` fetches it), so the
welcome page, which recommends a usable first model, never shows: the first load of the
default model says once which catalog model fits this machine, with a one-click download
(the window on a fake engine; the recommendation fixed, as it depends on this machine)."""
from __future__ import annotations

import pytest

import models
import runtime
from desktop.chat.pages import notice_link
from desktop.download_dialog import DownloadDialog
from desktop.model_switcher.recommend import Recommendation
from desktop.worker import EngineWorker
from tests.desktop.fakes import fake_load, fake_session_factory

DEFAULT, BIG = models.DEFAULT_MODEL, models.get("smollm2-1.7b-instruct")
WHY = "the largest chat model in the catalog that fits this machine"


@pytest.fixture
def recommended(monkeypatch):
    """What recommend() gives (set ``recommended.entry``); it records its calls."""
    from desktop.model_switcher import dialog as switcher

    class R:
        entry = BIG
        calls = 0

    def fake(**kw):
        R.calls += 1
        return Recommendation(R.entry, {"verdict": "fits"}, WHY) if R.entry else None

    monkeypatch.setattr(switcher, "recommend", fake)
    return R


def _load(qtbot, w, path) -> None:
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(path))


def test_the_first_load_of_the_default_model_recommends_a_better_one_once(qtbot, make_window, tmp_path, recommended):
    default = tmp_path / DEFAULT.filename
    w = make_window(load=False)
    w.model_switcher.installed_fn = lambda e: default if e.id == DEFAULT.id else None
    _load(qtbot, w, default)
    text = w.notice.text()
    assert w.notice.isVisible() and w.notice.property("kind") == "note"
    assert text.startswith("SmolLM2-135M-Instruct is for the first minute and offline use; it often repeats itself.")
    assert notice_link("recommend", "Download SmolLM2-1.7B-Instruct (1,010.9 MiB)", "note") in text
    assert f"{WHY}." in text
    w.notice.linkActivated.emit("recommend")   # a click on the link
    shown = w.findChild(DownloadDialog)
    assert shown is not None and shown.entry is BIG and not w.notice.isVisible()
    shown.close()
    # Said once: not after another load, nor in the next session's window.
    _load(qtbot, w, "fake.gguf")
    _load(qtbot, w, default)
    assert not w.notice.isVisible()
    again = make_window(load=False)
    _load(qtbot, again, default)
    assert not again.notice.isVisible()


def _cpu_only(source: str, device: str):
    """A machine without CUDA: a load on ``cuda:0`` raises as runtime.load_model does."""
    if device == "cuda:0":
        raise runtime.DeviceError("cuda:0 is not available on this machine")
    return fake_load(source, device)


@pytest.mark.parametrize("case", ["another model", "the default is the best", "already downloaded", "none fits",
                                  "a notice of the load"])
def test_no_note_where_there_is_nothing_better_to_offer_or_a_notice_is_shown(qtbot, make_window, tmp_path,
                                                                             recommended, case):
    default = tmp_path / DEFAULT.filename
    big = tmp_path / BIG.filename
    w = make_window(load=False, worker=EngineWorker(load_fn=_cpu_only, session_fn=fake_session_factory()))
    w.model_switcher.installed_fn = {"already downloaded": lambda e: {DEFAULT.id: default, BIG.id: big}.get(e.id)}.get(
        case, lambda e: default if e.id == DEFAULT.id else None)
    recommended.entry = {"the default is the best": DEFAULT, "none fits": None}.get(case, BIG)
    if case == "a notice of the load":
        w.settings.set("model/device", "cuda:0")   # a settings file from another machine
    _load(qtbot, w, tmp_path / "other.gguf" if case == "another model" else default)
    if case == "a notice of the load":   # the fallback's notice stays; the offer waits for the next load
        assert w.notice.isVisible() and w.notice.text().startswith("The device cuda:0 is not available")
        assert recommended.calls == 0
        w.settings.set("model/device", "auto")
        _load(qtbot, w, default)
        assert "Download SmolLM2-1.7B-Instruct" in w.notice.text()
        return
    assert not w.notice.isVisible()
    assert recommended.calls == (0 if case == "another model" else 1)   # the fit is not planned for another model
