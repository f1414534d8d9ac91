"""File > Models…: switch between the catalog's models; one not downloaded yet shows its size
and license before the download.

The list holds every :data:`models.CATALOG` entry with its state (loaded, installed, not
downloaded). The details of the selected one: what it is, its size in bytes on disk, its
license (a link to the text), its attention (layers, KV heads, sliding window) and what
its KV cache takes, and whether it chats or continues text. **Load** loads an installed
model on the engine (the window's :meth:`load_model`); **Download…** opens the download
dialog for it (it names the size and license again and asks first), and a finished
download is loaded. Must not import torch or runtime.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton, QVBoxLayout,
)

import models
from desktop.download_dialog import DownloadDialog

__all__ = ["ModelsDialog", "ModelSwitcher", "install", "details_html"]

MIB = 2**20
#: The context the details quote the KV cache at (tokens; capped by the model's own).
QUOTED_CONTEXT = 8192


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def attention_text(e: models.CatalogEntry) -> str:
    """``"18 layers, 1 KV head of 256 (multi-query); 15 of 18 layers slide over 512 tokens"``."""
    heads = f"{e.n_kv_heads} KV head{'s' if e.n_kv_heads != 1 else ''} of {e.head_dim}"
    kind = " (multi-query)" if e.n_kv_heads == 1 else ""
    window = (f"; {e.sliding_layers} of {e.n_layers} layers slide over {e.sliding_window:,} tokens"
              if e.sliding_window else "; every layer sees the whole context")
    return f"{e.n_layers} layers, {heads}{kind}{window}"


def _where_from(e: models.CatalogEntry) -> str:
    """``"the Python package index"`` or ``"the Hugging Face Hub (hf.co/OWNER/REPO)"``."""
    return f"the Hugging Face Hub ({html.escape(e.ref)})" if e.source == "hub" else "the Python package index"


def details_html(e: models.CatalogEntry, state: str, path: Path | None) -> str:
    """The details pane of entry ``e``: ``state`` is ``"loaded"``, ``"installed"`` or ``"missing"``."""
    lic = html.escape(e.license)
    if e.license_url:
        lic = f'<a href="{html.escape(e.license_url)}">{lic}</a>'
    ctx = min(QUOTED_CONTEXT, e.context_length)
    kv = (f"{e.kv_bytes_per_token():,} bytes per token in float32; {e.kv_bytes_at(ctx) / MIB:,.1f} MiB "
          f"at {ctx:,} tokens")
    mode = ("chats with its own template" if e.chat_template
            else "a base model without a chat template: it continues the text you write (plain completion)")
    where = {"loaded": "Loaded now.", "installed": f"Installed: <code>{html.escape(str(path))}</code>",
             "missing": (f"Not downloaded: {_mb(e.size_bytes)} from {_where_from(e)}, checked "
                         f"against its SHA-256. By downloading it you accept its license ({lic}).")}[state]
    rows = [("Size", f"{_mb(e.size_bytes)} ({e.size_bytes:,} bytes)"), ("License", lic),
            ("Parameters", f"{e.parameters / 1e6:,.0f} M ({html.escape(e.architecture)})"),
            ("Context", f"{e.context_length:,} tokens"), ("Attention", html.escape(attention_text(e))),
            ("KV cache", kv), ("Use", html.escape(mode))]
    table = "".join(f"<tr><td><b>{k}</b>&nbsp;&nbsp;</td><td>{v}</td></tr>" for k, v in rows)
    return (f"<h3>{html.escape(e.name)}</h3><p>{html.escape(e.description)}</p>"
            f"<table>{table}</table><p>{where}</p>")


class ModelsDialog(QDialog):
    """The catalog's models; :attr:`load_requested` carries the path to load.

    Args:
        loaded_path: the loaded model's file ("" if none).
        installed_fn: ``(entry) -> Path | None`` (default :func:`models.installed_path`).
        fetch_fn: the download dialog's fetch (default :func:`models.fetch_model`).
        catalog: the entries to list (default :data:`models.CATALOG`).
    """

    load_requested = Signal(str)

    def __init__(self, parent=None, *, loaded_path: str = "", installed_fn: Callable | None = None,
                 fetch_fn: Callable | None = None, catalog=None):
        super().__init__(parent)
        self.setObjectName("modelsDialog")
        self.setWindowTitle("Models")
        self.setMinimumSize(640, 400)
        self.catalog = tuple(catalog or models.CATALOG)
        self.loaded_path = loaded_path
        self._installed = installed_fn or models.installed_path
        self._fetch = fetch_fn
        self.download: DownloadDialog | None = None
        self.list = QListWidget()
        self.list.setObjectName("modelsList")
        self.list.setMinimumWidth(250)
        self.list.setWordWrap(True)
        self.list.setSpacing(3)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.details = QLabel()
        self.details.setObjectName("modelDetails")
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.TextFormat.RichText)
        self.details.setOpenExternalLinks(True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.load_button = QPushButton("Load")
        self.download_button = QPushButton("Download…")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.addButton(self.download_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.addButton(self.load_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.rejected.connect(self.reject)
        self.load_button.clicked.connect(self._load)
        self.download_button.clicked.connect(self._download)
        self.list.currentRowChanged.connect(self._show)
        self.list.itemDoubleClicked.connect(lambda _item: self.load_button.isEnabled() and self._load())
        body = QHBoxLayout()
        body.addWidget(self.list, 2)
        body.addWidget(self.details, 5)
        lay = QVBoxLayout(self)
        lay.addLayout(body, 1)
        lay.addWidget(buttons)
        self.refresh()
        self.list.setCurrentRow(next((i for i in range(len(self.catalog)) if self.state(i) == "loaded"), 0))

    # ---- states ------------------------------------------------------------------------------
    def path(self, row: int) -> Path | None:
        try:
            return self._installed(self.catalog[row])
        except OSError:   # the model folder cannot be made: nothing is installed
            return None

    def state(self, row: int) -> str:
        """``"loaded"``, ``"installed"`` or ``"missing"``."""
        p = self.path(row)
        if p is None:
            return "missing"
        return "loaded" if self.loaded_path and Path(self.loaded_path) == p else "installed"

    def refresh(self) -> None:
        """Rebuild the list's rows (after a download or a load)."""
        row = max(self.list.currentRow(), 0)
        self.list.blockSignals(True)
        self.list.clear()
        for i, e in enumerate(self.catalog):
            tag = {"loaded": "loaded", "installed": "installed", "missing": f"{_mb(e.size_bytes)} to download"}
            item = QListWidgetItem(f"{e.name}\n{tag[self.state(i)]} · {e.license}")
            item.setData(Qt.ItemDataRole.UserRole, e.id)
            self.list.addItem(item)
        self.list.blockSignals(False)
        self.list.setCurrentRow(min(row, len(self.catalog) - 1))
        self._show(self.list.currentRow())

    def _show(self, row: int) -> None:
        if not 0 <= row < len(self.catalog):
            return
        state = self.state(row)
        self.details.setText(details_html(self.catalog[row], state, self.path(row)))
        self.load_button.setEnabled(state == "installed")
        self.load_button.setText("Loaded" if state == "loaded" else "Load")
        self.download_button.setVisible(state == "missing")
        self.load_button.setDefault(state == "installed")
        self.download_button.setDefault(state == "missing")

    # ---- actions -----------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.path(self.list.currentRow())
        if path is not None:
            self.load_requested.emit(str(path))
            self.accept()

    def _download(self) -> DownloadDialog:
        """Open the download dialog for the selected model (it asks before fetching)."""
        entry = self.catalog[self.list.currentRow()]
        self.download = DownloadDialog(self, fetch_fn=self._fetch, entry=entry,
                                       headline=f"Switch to {entry.name}.")
        self.download.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.download.downloaded.connect(self._downloaded)
        self.download.open()
        return self.download

    def _downloaded(self, path: str) -> None:
        self.refresh()
        self.load_requested.emit(path)
        self.accept()


class ModelSwitcher:
    """File > Models… in a window: the menu action and the dialog it opens."""

    def __init__(self, window, *, fetch_fn: Callable | None = None, installed_fn: Callable | None = None):
        self.window, self.fetch_fn, self.installed_fn = window, fetch_fn, installed_fn
        self.dialog: ModelsDialog | None = None
        self.action = QAction("&Models…", window)
        self.action.setObjectName("modelsAction")
        self.action.setShortcut("Ctrl+M")
        self.action.setStatusTip("Switch between the catalog's models; download one (size and license shown first)")
        self.action.triggered.connect(self.open)
        window.add_file_action(self.action)

    def open(self) -> ModelsDialog:
        """Open the dialog (not blocking); a chosen or downloaded model is loaded."""
        info = self.window.engine.model or {}
        loaded = "" if info.get("remote") else str(info.get("path") or "")
        self.dialog = ModelsDialog(self.window, loaded_path=loaded, fetch_fn=self.fetch_fn,
                                   installed_fn=self.installed_fn)
        self.dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.dialog.load_requested.connect(self.window.load_model)
        self.dialog.open()
        return self.dialog


def install(window, **kwargs) -> ModelSwitcher:
    """Add File > Models… to ``window`` (a MainWindow)."""
    return ModelSwitcher(window, **kwargs)
