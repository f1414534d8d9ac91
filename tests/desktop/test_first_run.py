"""First run: the download dialog (progress, Cancel, failures in words, Retry) and the empty state."""
from __future__ import annotations

import threading
from pathlib import Path

import models
from desktop import app as desktop_app
from desktop.download_dialog import DownloadDialog


def fetch_ok(entry, progress, cancel):
    for done in range(0, 101, 25):
        progress(done, 100)
    return Path("/models/fake.gguf")


def test_download_succeeds_with_progress(qtbot):
    dialog = DownloadDialog(fetch_fn=fetch_ok)
    qtbot.addWidget(dialog)
    dialog.show()
    with qtbot.waitSignal(dialog.downloaded, timeout=5000) as blocker:
        dialog.download_button.click()
    assert blocker.args == ["/models/fake.gguf"]
    assert not dialog.running and not dialog.isVisible()


def test_download_failure_is_shown_in_words_with_retry(qtbot):
    calls = []

    def fetch(entry, progress, cancel):
        calls.append(1)
        if len(calls) == 1:
            raise models.FetchError("disk full while fetching SmolLM2 (93 MiB needed); free some space and try again")
        return fetch_ok(entry, progress, cancel)

    dialog = DownloadDialog(fetch_fn=fetch)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.download_button.click()
    qtbot.waitUntil(lambda: dialog.retry_button.isVisible(), timeout=5000)
    assert "disk full" in dialog.status.text() and "Traceback" not in dialog.status.text()
    with qtbot.waitSignal(dialog.downloaded, timeout=5000):
        dialog.retry_button.click()
    assert len(calls) == 2


def test_cancel_stops_the_download(qtbot):
    started = threading.Event()

    def fetch(entry, progress, cancel):
        started.set()
        progress(10, 100)
        while not cancel():
            threading.Event().wait(0.01)
        raise models.FetchCancelled("fetching was cancelled")

    dialog = DownloadDialog(fetch_fn=fetch)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.download_button.click()
    assert started.wait(5)
    qtbot.waitUntil(lambda: dialog.bar.maximum() > 0, timeout=5000)
    dialog.cancel_button.click()
    qtbot.waitUntil(lambda: not dialog.running, timeout=5000)
    assert "Cancelled" in dialog.status.text() and dialog.retry_button.isVisible()
    dialog.cancel_button.click()  # now "Close"
    assert not dialog.isVisible()


def test_first_run_shows_the_empty_state_and_offers_the_download(qtbot, make_window, monkeypatch):
    monkeypatch.setattr(models, "installed_path", lambda *a: None)
    w = make_window(load=False)
    dialog = desktop_app.start_model(w, None, fetch_fn=fetch_ok)
    assert dialog is not None and dialog.isVisible()
    assert w.stack.currentWidget() is w.empty and not w.send_button.isEnabled()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as blocker:
        dialog.download_button.click()
    assert blocker.args[0]["path"] == "/models/fake.gguf"
    assert w.stack.currentWidget() is not w.empty and w.send_button.isEnabled()


def test_the_bar_and_the_line_under_it_say_the_same_thing(qtbot):
    """The byte counts come while the downloaded package is saved and hashed: the bar says
    "saved" and the line says what is being done, not a download beside a check."""
    gate, seen = threading.Event(), threading.Event()

    def fetch(entry, progress, cancel):
        progress(41_800_000, 98_400_000)
        seen.set()
        gate.wait(5)
        return fetch_ok(entry, progress, cancel)

    dialog = DownloadDialog(fetch_fn=fetch)
    qtbot.addWidget(dialog)
    dialog.show()
    assert dialog.status.text() == ""
    dialog.download_button.click()
    # pip reports no bytes while it downloads: the line says what is happening, and for how long.
    assert dialog.status.text().startswith("Downloading 93.8 MiB from the package index… 0 s so far (the bar")
    assert dialog.bar.maximum() == 0
    assert seen.wait(5)
    qtbot.waitUntil(lambda: dialog.bar.maximum() > 0, timeout=5000)
    assert dialog.bar.text() == "39.9 of 93.8 MiB · 42 % saved"
    assert dialog.status.text() == "Downloaded. Saving the model and checking its SHA-256…"
    dialog.show_progress(98_400_000, 98_400_000)
    assert dialog.bar.text() == "93.8 of 93.8 MiB · 100 % saved"
    assert dialog.status.text() == "Saved. Checking its SHA-256…"
    with qtbot.waitSignal(dialog.downloaded, timeout=5000):
        gate.set()


def test_pips_own_bytes_show_while_it_downloads(qtbot):
    """The package index's download showed a busy bar until pip had the whole package: pip's
    own counts (``downloading``) now fill the bar while it downloads, then the saving counts."""
    gate, seen = threading.Event(), threading.Event()

    def fetch(entry, progress, cancel, downloading):
        downloading(24_500_000, 98_000_000)
        seen.set()
        gate.wait(5)
        progress(49_200_000, 98_400_000)
        return fetch_ok(entry, progress, cancel)

    dialog = DownloadDialog(fetch_fn=fetch)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.download_button.click()
    assert seen.wait(5)
    qtbot.waitUntil(lambda: dialog.bar.maximum() > 0 and dialog.bar.value() == 250, timeout=5000)
    assert dialog.bar.text().startswith("23.4 of 93.5 MiB · 25 %") and "saved" not in dialog.bar.text()
    assert dialog.status.text() == "Downloading from the package index…"
    with qtbot.waitSignal(dialog.downloaded, timeout=5000):
        gate.set()
    assert "saved" in dialog.bar.text()


def test_a_long_failure_is_shown_whole(qtbot):
    """The failure under the intro was cut off at the dialog's bottom."""
    from PySide6.QtWidgets import QLabel

    def fetch(entry, progress, cancel):
        raise models.FetchError("listing hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF: cannot reach the Hugging Face "
                                "Hub at https://huggingface.co (ConnectError); check the network connection, or use "
                                "a model you already have (`attnchat models list`, `attnchat models import PATH`)")

    dialog = DownloadDialog(fetch_fn=fetch)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.resize(480, dialog.minimumSizeHint().height())
    dialog.download_button.click()
    qtbot.waitUntil(lambda: dialog.retry_button.isVisible(), timeout=5000)
    qtbot.wait(50)
    for label in dialog.findChildren(QLabel):
        if label.isVisible() and label.text():
            assert label.height() >= label.heightForWidth(label.width()), label.text()[:40]
    assert "File > Models…" in dialog.status.text() and "attnchat models" not in dialog.status.text()


def test_the_first_run_dialog_also_offers_the_model_recommended_for_this_machine(qtbot, make_window, monkeypatch):
    """It offered only the default model (which loops) and covered the welcome page's recommendation."""
    from desktop.model_switcher import dialog as switcher
    from desktop.model_switcher.recommend import Recommendation

    big = models.get("smollm2-1.7b-instruct")
    why = "the largest chat model in the catalog that fits this machine"
    monkeypatch.setattr(switcher, "recommend", lambda **kw: Recommendation(big, {"verdict": "fits"}, why))
    monkeypatch.setattr(models, "installed_path", lambda *a: None)
    w = make_window(load=False)
    dialog = desktop_app.start_model(w, None, fetch_fn=fetch_ok)
    assert dialog.entry is models.DEFAULT_MODEL and dialog.download_button.isVisible()
    assert dialog.download_button.text() == "Download SmolLM2-135M-Instruct (93.8 MiB)"
    assert dialog.instead_button.isVisible()
    assert dialog.instead_button.text() == "Download SmolLM2-1.7B-Instruct (1,010.9 MiB)"
    assert dialog.instead_button.toolTip() == why
    assert "Better answers: <b>SmolLM2-1.7B-Instruct</b> (1,010.9 MiB) fits this machine" in dialog.intro.text()
    dialog.instead_button.click()
    assert not dialog.isVisible()
    other = next(d for d in w.findChildren(DownloadDialog) if d is not dialog and d.isVisible())
    assert other.entry is big and "Download <b>SmolLM2-1.7B-Instruct</b> (1,010.9 MiB, " in other.intro.text()
    other.close()


def test_no_second_offer_when_the_default_model_is_the_recommendation(qtbot, make_window, monkeypatch):
    from desktop.model_switcher import dialog as switcher
    from desktop.model_switcher.recommend import Recommendation

    monkeypatch.setattr(switcher, "recommend", lambda **kw: Recommendation(models.DEFAULT_MODEL, {}, "only this fits"))
    monkeypatch.setattr(models, "installed_path", lambda *a: None)
    w = make_window(load=False)
    dialog = desktop_app.start_model(w, None, fetch_fn=fetch_ok)
    assert not hasattr(dialog, "instead_button") and "Better answers" not in dialog.intro.text()
    assert dialog.download_button.text() == "Download"
    dialog.close()
