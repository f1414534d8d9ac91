"""The desktop app's entry point: ``main(args) -> int``.

Makes the QApplication (the system's light or dark palette, unless ``ATTNCHAT_THEME``
says ``light`` or ``dark``), opens the conversation database and the settings,
starts the engine worker, shows the window, and runs the first-run flow (offer to
download the default model when it is missing). ``--self-test`` and
``--screenshot DIR`` live in :mod:`desktop.selftest` and :mod:`desktop.screenshots`.
Must not import torch.
"""
from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
from pathlib import Path

from PySide6.QtCore import QtMsgType, QStandardPaths, Qt, qInstallMessageHandler
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication, QMessageBox

import models
from desktop import connect_dialog, serve_toggle
from models import logfile
from desktop.attention_panel import install_attention_panel
from desktop.download_dialog import DownloadDialog
from desktop.kv_panel import install_kv_panel
from desktop.main_window import MainWindow
from desktop.qt_compat import guard_none_refcount
from desktop.remote_client import is_remote_source
from desktop.remote_engine import RemoteEngineWorker
from desktop.settings import Settings
from desktop.settings_dialog import install_settings
from desktop.store import SchemaTooNewError, Store
from desktop.worker import Engine

__all__ = ["main", "application", "build_window", "dark_palette", "light_palette", "apply_theme", "data_dir", "start_model",
           "report_unexpected"]

log = logging.getLogger(__name__)
DATA_DIR_ENV = "ATTNCHAT_DATA_DIR"
THEME_ENV = "ATTNCHAT_THEME"


def data_dir() -> Path:
    """Where conversations live: ``$ATTNCHAT_DATA_DIR`` or the user data folder (``~/.local/share/attnchat``)."""
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    base = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.GenericDataLocation)
    return Path(base or Path.home()) / "attnchat"


def application(headless: bool = False) -> QApplication:
    """The QApplication (made once). ``headless``: the offscreen platform unless one is set."""
    guard_none_refcount()  # before any other Qt call: see desktop.qt_compat
    app = QApplication.instance()
    if app is None:
        if headless:
            os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        qInstallMessageHandler(_qt_message)
        app = QApplication(sys.argv[:1])
        app.setApplicationName("attnchat")
        app.setApplicationDisplayName("attnchat")
        app.setDesktopFileName("attnchat")
        theme = os.environ.get(THEME_ENV, "").strip().lower()
        if theme in ("light", "dark"):
            apply_theme(app, theme)
    return app  # type: ignore[return-value]


def _qt_message(kind: QtMsgType, context, message: str) -> None:
    """Qt's own messages go to the log file, not the user's terminal."""
    if "propagateSizeHints" in message:  # the offscreen platform's noise
        return
    level = {QtMsgType.QtDebugMsg: logging.DEBUG, QtMsgType.QtInfoMsg: logging.INFO,
             QtMsgType.QtWarningMsg: logging.WARNING}.get(kind, logging.ERROR)
    logging.getLogger("qt").log(level, "%s", message)


def dark_palette() -> QPalette:
    """A dark palette (Fusion's colours), for ``ATTNCHAT_THEME=dark`` and screenshots."""
    p = QPalette()
    c = {
        QPalette.ColorRole.Window: "#2b2b2b", QPalette.ColorRole.WindowText: "#e6e6e6",
        QPalette.ColorRole.Base: "#1f1f1f", QPalette.ColorRole.AlternateBase: "#2f2f2f",
        QPalette.ColorRole.Text: "#e6e6e6", QPalette.ColorRole.Button: "#353535",
        QPalette.ColorRole.ButtonText: "#e6e6e6", QPalette.ColorRole.BrightText: "#ff5555",
        QPalette.ColorRole.Highlight: "#3d7bd9", QPalette.ColorRole.HighlightedText: "#ffffff",
        QPalette.ColorRole.ToolTipBase: "#353535", QPalette.ColorRole.ToolTipText: "#e6e6e6",
        QPalette.ColorRole.Link: "#78aaff", QPalette.ColorRole.PlaceholderText: "#9a9a9a",
        QPalette.ColorRole.Light: "#4a4a4a", QPalette.ColorRole.Midlight: "#3c3c3c",
        QPalette.ColorRole.Mid: "#2f2f2f", QPalette.ColorRole.Dark: "#1a1a1a", QPalette.ColorRole.Shadow: "#0d0d0d",
    }
    for role, color in c.items():
        p.setColor(role, QColor(color))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#7a7a7a"))
    return p


def light_palette(app: QApplication) -> QPalette:
    return app.style().standardPalette()


def apply_theme(app: QApplication, theme: str) -> None:
    """Force ``"light"`` or ``"dark"`` (the default is to follow the system)."""
    app.setPalette(dark_palette() if theme == "dark" else light_palette(app))


def build_window(store: Store, settings: Settings, engine: Engine | None = None, **kwargs) -> MainWindow:
    """The main window with its panels: the app, ``--self-test`` and ``--screenshot`` all use this.

    Panels (KV-cache memory, attention) are added here with ``window.add_panel(...)``.
    """
    window = MainWindow(store, settings, engine or Engine(RemoteEngineWorker()), **kwargs)
    # File > Connect to server… (remote engines) and Server > Serve the loaded model.
    window.connector = connect_dialog.install(window)
    window.serve_toggle = serve_toggle.install(window)
    install_settings(window)   # Edit > Settings… (desktop.settings_dialog)
    install_kv_panel(window)   # the KV-cache memory dock (desktop.kv_panel)
    install_attention_panel(window)  # the attention dock (desktop.attention_panel)
    return window


def _no_display() -> bool:
    """Linux/BSD without X11 or Wayland, and no platform chosen: Qt would abort."""
    if not sys.platform.startswith(("linux", "freebsd")) or os.environ.get("QT_QPA_PLATFORM"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _open_store() -> Store:
    return Store(data_dir() / "conversations.sqlite3")


def start_model(window: MainWindow, source: str | None, *, fetch_fn=None) -> DownloadDialog | None:
    """Load ``source``, or the last model, or the default one; offer to download it when missing.

    Returns the download dialog when one was opened (already shown, not modal-blocking).
    """
    if source:
        window.load_model(source)
        return None
    saved = window.settings.get("model/source")
    if saved and (is_remote_source(saved) or Path(saved).exists()):
        window.load_model(saved)
        return None
    if models.installed_path() is not None:
        window.load_model("")
        return None
    window.show_first_run()
    return offer_download(window, fetch_fn=fetch_fn)


def offer_download(window: MainWindow, *, fetch_fn=None) -> DownloadDialog:
    """Open the download dialog; a successful download loads the model."""
    dialog = DownloadDialog(window, fetch_fn=fetch_fn)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.downloaded.connect(lambda path: window.load_model(path))
    dialog.open()
    return dialog


def report_unexpected(window: MainWindow, exc_type, exc, tb) -> None:
    """``sys.excepthook`` while the window is open (an exception escaping a Qt slot lands here):
    the traceback goes to the log file, one line to the window, and the app runs on."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    log.error("unexpected error", exc_info=(exc_type, exc, tb))
    lines = str(exc).strip().splitlines()
    try:
        where = f" ({logfile.log_file()})"
    except OSError:
        where = ""
    window.show_error(f"Something went wrong ({exc_type.__name__}: {lines[0] if lines else 'no details'}); "
                      f"the details are in the log file{where}.")


def main(args: argparse.Namespace) -> int:
    """Run the desktop app; returns the exit status."""
    logfile.to_file()   # tracebacks go to the log file, never to the window or the terminal
    if getattr(args, "self_test", False):
        from desktop.selftest import run as self_test

        return self_test(args)
    if getattr(args, "screenshot", None):
        from desktop.screenshots import run as screenshots

        return screenshots(args)
    if _no_display():
        print("attnchat: error: no display found (DISPLAY and WAYLAND_DISPLAY are unset); "
              "run `attnchat --terminal` to chat in the terminal", file=sys.stderr)
        return 2
    app = application()
    try:
        store = _open_store()
    except (sqlite3.DatabaseError, SchemaTooNewError, OSError) as e:
        log.exception("could not open the conversation database")
        QMessageBox.critical(None, "attnchat", f"The conversation database could not be opened: {e}")
        print(f"attnchat: error: the conversation database could not be opened ({e}); "
              f"move it aside or set {DATA_DIR_ENV}", file=sys.stderr)
        return 2
    settings = Settings()
    if getattr(args, "device", None) and args.device != "auto":
        settings.set("model/device", args.device)
    window = build_window(store, settings)
    window.download_requested.connect(lambda: offer_download(window))
    previous_hook = sys.excepthook
    sys.excepthook = lambda *exc: report_unexpected(window, *exc)
    window.show()
    start_model(window, getattr(args, "model", None))
    try:
        return app.exec()
    finally:
        window.close()
        store.close()
        sys.excepthook = previous_hook
