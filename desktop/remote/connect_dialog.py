"""File > Connect to server…: chat through an OpenAI-compatible server instead of a local model.

The dialog asks for the server's base URL, an optional API key and a model, picked
from the server's own list (``GET /v1/models``, fetched off the GUI thread). The key
goes to a :class:`desktop.remote.secrets.KeyStore` (the system keyring, else memory only, and
the dialog says which); the settings keep only the URL. Accepting loads the source
``<base URL>#model=<id>`` (see :mod:`desktop.remote.client`).

Must not import torch or runtime.
"""
from __future__ import annotations

import threading
from typing import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
)

from desktop.remote.client import (
    RemoteEngineError,
    is_remote_source,
    list_models,
    normalize_base_url,
    parse_remote_source,
    remote_source,
)
from desktop.remote.secrets import KeyStore

__all__ = ["ConnectDialog", "Connector", "DEFAULT_URL", "install"]

DEFAULT_URL = "http://127.0.0.1:8000/v1"
INTRO = ("Chat with a model that runs on a server with OpenAI's API: attnchat serve, vLLM, llama.cpp's "
         "server, Ollama… Conversations and stats work as with a local model; the KV-cache and attention "
         "panels need a local model.")


class _Relay(QObject):
    """Carries a model list from the fetching thread to the dialog (queued to the GUI thread)."""

    done = Signal(int, object)  # generation, list of model dicts or an error string


class ConnectDialog(QDialog):
    """Base URL, API key and model of a server.

    Args:
        keys: where the key is kept.
        base_url, model: the starting values.
        lister: ``(base_url, key) -> [{"id", ...}]`` (default :func:`desktop.remote.client.list_models`).
    """

    models_listed = Signal(object)   # the list of model ids, or an error string

    def __init__(self, keys: KeyStore, base_url: str = "", model: str = "", parent=None,
                 lister: Callable[[str, str], list[dict]] = list_models):
        super().__init__(parent)
        self.setObjectName("connectDialog")
        self.setWindowTitle("Connect to a server")
        self.keys, self._lister = keys, lister
        self._generation = 0
        self._asked: tuple[str, str] | None = None
        self._relay = _Relay()
        self._relay.done.connect(self._on_listed)

        intro = QLabel(INTRO)
        intro.setWordWrap(True)
        self.url_edit = QLineEdit(base_url or DEFAULT_URL)
        self.url_edit.setObjectName("urlEdit")
        self.url_edit.setPlaceholderText(DEFAULT_URL)
        self.key_edit = QLineEdit()
        self.key_edit.setObjectName("keyEdit")
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("none (a server on this machine usually needs none)")
        self.key_note = QLabel(keys.where())
        self.key_note.setObjectName("keyNote")
        self.key_note.setWordWrap(True)
        self.model_box = QComboBox()
        self.model_box.setObjectName("modelBox")
        self.model_box.setEditable(True)
        self.model_box.setMinimumContentsLength(24)
        self.model_box.lineEdit().setPlaceholderText("the server's first model")
        if model:
            self.model_box.addItem(model)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setToolTip("Ask the server for its models again")
        self.list_status = QLabel("")
        self.list_status.setObjectName("listStatus")
        self.list_status.setWordWrap(True)
        self.list_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        for note in (self.key_note, self.list_status):
            # A word-wrapped label asks for a narrow column; let it take the field's width.
            note.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
            note.setMinimumWidth(380)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_box, 1)
        model_row.addWidget(self.refresh_button)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
        form.addRow("Server address:", self.url_edit)
        form.addRow("API key:", self.key_edit)
        form.addRow("", self.key_note)
        form.addRow("Model:", model_row)
        form.addRow("", self.list_status)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setDefault(True)
        lay = QVBoxLayout(self)
        lay.setSpacing(12)
        lay.addWidget(intro)
        lay.addLayout(form)
        lay.addStretch(1)
        lay.addWidget(self.buttons)
        self.setMinimumWidth(560)

        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.refresh_button.clicked.connect(lambda: self.fetch_models(force=True))
        self.url_edit.editingFinished.connect(self._url_edited)
        self.key_edit.editingFinished.connect(self.fetch_models)
        self.url_edit.textChanged.connect(self._validate)
        self._url_edited()

    # ---- values ----------------------------------------------------------------------------
    def base_url(self) -> str:
        """The normalized base URL ("" when the text is not an address)."""
        try:
            return normalize_base_url(self.url_edit.text())
        except ValueError:
            return ""

    def key(self) -> str:
        return self.key_edit.text().strip()

    def model(self) -> str:
        return self.model_box.currentText().strip()

    def source(self) -> str:
        """The source to load: ``<base URL>#model=<id>``."""
        return remote_source(self.base_url(), self.model())

    # ---- the model list --------------------------------------------------------------------
    def _url_edited(self) -> None:
        url = self.base_url()
        if url and not self.key_edit.text():
            self.key_edit.setText(self.keys.get(url))
        self._validate()
        self.fetch_models()

    def _validate(self) -> bool:
        try:
            normalize_base_url(self.url_edit.text())
        except ValueError as e:
            self.connect_button.setEnabled(False)
            self.list_status.setText(str(e)[:1].upper() + str(e)[1:] + ".")
            return False
        self.connect_button.setEnabled(True)
        return True

    def fetch_models(self, force: bool = False) -> None:
        """Ask the server for its models, off the GUI thread (:attr:`models_listed` when done)."""
        url = self.base_url()
        if not url or (not force and self._asked == (url, self.key())):
            return
        self._asked = (url, self.key())
        self._generation += 1
        generation, key, relay, lister = self._generation, self.key(), self._relay, self._lister
        self.list_status.setText(f"Asking {url} for its models…")
        self.refresh_button.setEnabled(False)

        def ask() -> None:
            try:
                result: object = [m["id"] for m in lister(url, key)]
            except RemoteEngineError as e:
                result = str(e)
            except Exception as e:  # noqa: BLE001 - shown in the dialog, in one line
                result = f"could not ask {url} for its models ({type(e).__name__}: {e})"
            try:
                relay.done.emit(generation, result)
            except RuntimeError:  # the dialog is gone
                pass

        threading.Thread(target=ask, name="attnchat-list-models", daemon=True).start()

    @Slot(int, object)
    def _on_listed(self, generation: int, result: object) -> None:
        if generation != self._generation:
            return  # an answer about an address no longer in the box
        self.refresh_button.setEnabled(True)
        if isinstance(result, str):
            self.list_status.setText(result[:1].upper() + result[1:] + ".")
            self._asked = None  # try again on the next edit
        else:
            ids = list(result)
            typed = self.model()
            self.model_box.clear()
            self.model_box.addItems(ids)
            if typed in ids:
                self.model_box.setCurrentIndex(ids.index(typed))
            elif typed:
                self.model_box.setEditText(typed)
            n = len(ids)
            self.list_status.setText("The server lists no models." if not n else
                                     f"The server lists {n} model{'s' if n != 1 else ''}.")
        self.models_listed.emit(result)

    # ---- accepting -------------------------------------------------------------------------
    def accept(self) -> None:
        if not self._validate():
            return
        self.keys.set(self.base_url(), self.key())
        super().accept()


class Connector(QObject):
    """File > Connect to server… in a window: the menu action and the dialog it opens."""

    def __init__(self, window, keys: KeyStore):
        super().__init__(window)
        self.window, self.keys = window, keys
        self.dialog: ConnectDialog | None = None
        self.action = QAction("&Connect to server…", window)
        self.action.setObjectName("connectAction")
        self.action.setStatusTip("Chat through an OpenAI-compatible server (attnchat serve, vLLM, llama.cpp, Ollama)")
        self.action.triggered.connect(self.open)
        window.add_file_action(self.action)

    def open(self) -> ConnectDialog:
        """Open the dialog (not blocking), filled with the server in use or the last one."""
        w = self.window
        info = w.engine.model or {}
        base_url, model = w.settings.get("remote/base_url"), ""
        if info.get("remote"):
            base_url, model = info["base_url"], info["name"]
        elif is_remote_source(w.settings.get("model/source")):
            try:
                base_url, model = parse_remote_source(w.settings.get("model/source"))
            except ValueError:
                pass
        dialog = ConnectDialog(self.keys, base_url, model, w)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.accepted.connect(lambda: self._connect(dialog))
        dialog.finished.connect(lambda result: self._closed(dialog))
        self.dialog = dialog
        dialog.open()
        return dialog

    def _closed(self, dialog: ConnectDialog) -> None:
        if self.dialog is dialog:
            self.dialog = None

    def _connect(self, dialog: ConnectDialog) -> None:
        self.window.settings.set("remote/base_url", dialog.base_url())
        self.window.load_model(dialog.source())


def install(window, keys: KeyStore | None = None) -> Connector:
    """Add File > Connect to server… to ``window`` (a MainWindow).

    ``keys`` defaults to the engine worker's key store, so the worker finds the key.
    """
    return Connector(window, keys or getattr(window.engine.worker, "keys", None) or KeyStore())
