"""The desktop app's pieces: the QApplication, its theme, the window with its panels, the first-run flow.

:mod:`desktop.launch` runs them (``main(args) -> int``). Makes the QApplication (the system's light or dark palette, unless ``ATTNCHAT_THEME``
says ``light`` or ``dark``), opens the conversation database and the settings,
starts the engine worker, shows the window, and runs the first-run flow (offer to
download the default model when it is missing). ``--self-test`` and
``--screenshot DIR`` (:mod:`desktop.selftest`, :mod:`desktop.screenshots`) use them too.
Must not import torch.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from PySide6.QtCore import QtMsgType, QStandardPaths, Qt, qInstallMessageHandler
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

import models
from desktop import model_switcher
from desktop.remote import connect_dialog
from desktop.remote import serve_toggle, server_panel
from models import logfile, paths
from desktop.panels.attention.panel import install_attention_panel
from desktop.download_dialog import DownloadDialog
from desktop.panels.kv.panel import install_kv_panel
from desktop.main_window import MainWindow
from desktop.qt_compat import guard_none_refcount
from desktop.remote.client import is_remote_source
from desktop.remote.engine import RemoteEngineWorker
from desktop.settings.values import Settings
from desktop.settings.controller import install_settings
from desktop.chat.store import Store
from desktop.widgets.wheel_guard import install_wheel_guard
from desktop.worker import Engine

__all__ = ["application", "build_window", "dark_palette", "light_palette", "apply_theme", "data_dir", "start_model",
           "report_unexpected", "open_store", "offer_download", "DATA_DIR_ENV"]

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
    install_wheel_guard(app)   # the wheel scrolls forms; it never turns a value under the pointer
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


def build_window(store: Store, settings: Settings, engine: Engine | None = None, *, serve_factory=None,
                 **kwargs) -> MainWindow:
    """The main window with its panels: the app, ``--self-test`` and ``--screenshot`` all use this.

    ``serve_factory`` serves the window's own model from this process (:mod:`desktop.remote.serve_toggle`).

    Panels (KV-cache memory, attention) are added here with ``window.add_panel(...)``.
    """
    window = MainWindow(store, settings, engine or Engine(RemoteEngineWorker()), **kwargs)
    # File > Connect to server… (remote engines) and Server > Serve the loaded model.
    window.connector = connect_dialog.install(window)
    window.model_switcher = model_switcher.install(window)   # File > Models… (desktop.model_switcher)
    window.serve_toggle = serve_toggle.install(window, serve_factory)
    window.server_panel = server_panel.install(window, window.serve_toggle)   # View > Server panel
    install_settings(window)   # Edit > Settings… (desktop.settings.controller)
    install_kv_panel(window)   # the KV-cache memory dock (desktop.panels.kv.panel)
    install_attention_panel(window)  # the attention dock (desktop.panels.attention.panel)
    return window


def start_model(window: MainWindow, source: str | None, *, fetch_fn=None) -> DownloadDialog | None:
    """Load ``source``, or the last model, or the default one; offer to download it when missing.

    Returns the download dialog when one was opened (already shown, not modal-blocking).
    """
    if source and models.hub.is_hub_ref(source) and not Path(source).exists():
        return _start_hub_model(window, source)
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


def _start_hub_model(window: MainWindow, source: str) -> None:
    """``--model hf.co/OWNER/REPO:QUANT``: load it when downloaded; otherwise open File > Models…
    on the Hub tab at that repo, so its quants' sizes, fits and license show before a download."""
    try:
        ref = models.hub.parse_ref(source)
    except models.HubError as exc:
        window.show_error(str(exc))
        return None
    path = models.hub.find_installed(ref, models.fetch.preferred_file(ref.repo_id))
    if path is not None:
        window.load_model(str(path))
        return None
    dialog = window.model_switcher.open()
    dialog.tabs.setCurrentIndex(dialog.HUB)
    dialog.browser.query.setText(ref.repo_id)
    dialog.browser.open_repo(ref.repo_id)
    return None


def offer_download(window: MainWindow, *, fetch_fn=None) -> DownloadDialog:
    """Open the download dialog; a successful download loads the model."""
    dialog = DownloadDialog(window, fetch_fn=fetch_fn)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.downloaded.connect(lambda path: window.load_model(path))
    switcher = getattr(window, "model_switcher", None)
    r = switcher.recommended if switcher is not None else None   # worked out as the welcome page showed
    if r is not None and r.entry.id != models.DEFAULT_MODEL.id:
        dialog.offer_instead(r.entry, r.reason)
        dialog.instead_requested.connect(switcher.download)
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


def open_store() -> Store:
    """The conversation database in :func:`data_dir` (made private, 0700, repaired on each start)."""
    return Store(paths.private_dir(data_dir()) / "conversations.sqlite3")
