"""The Server panel (View > Server): what Server > Serve the loaded model is doing, for the
people who point other apps at it.

It shows the state and the address (with Copy), how the server runs requests and its KV page
pool drawn against its limit (:mod:`.pool_bar`), the port (chosen free once and kept in the
settings, so a client configured once keeps working; a change applies at the next start), the
API key when the settings ask for one (hidden until Show; Copy), and a request log: each reply
the server finished, with its time, client, tokens and speed, read from the server's own
``GET /v1/attnchat/stats`` every :data:`POLL_MS` while it serves (loopback; with the key).

Must not import torch, runtime or attnchat (the toggle runs the server: :mod:`.serve_toggle`).
"""
from __future__ import annotations

import json
import logging
import time

from PySide6.QtCore import Qt, QTimer, QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkReply, QNetworkRequest
from PySide6.QtWidgets import (
    QCheckBox, QDockWidget, QFormLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPushButton, QScrollArea,
    QSpinBox,
    QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from desktop.remote.pool_bar import PoolBar, mode_text, pool_segments, pool_summary

__all__ = ["LOG_COLUMNS", "POLL_MS", "ServerPanel", "install", "log_rows"]

log = logging.getLogger(__name__)

#: How often the log is read while the server serves (ms).
POLL_MS = 2000
LOG_COLUMNS = ("time", "client", "tokens", "speed", "ended")
#: Rows kept in the log (the server remembers its last requests; this is what the table shows).
MAX_ROWS = 200


def log_rows(stats: dict) -> list[tuple[str, str, str, str, str]]:
    """The request log's rows, newest first, from the server's ``/v1/attnchat/stats`` answer
    (its ``last`` entries): ``("14:02:07", "127.0.0.1", "31 -> 120", "9.4 tok/s", "stop")``."""
    rows = []
    for e in (stats.get("last") or [])[:MAX_ROWS]:
        if not isinstance(e, dict):
            continue
        when = time.strftime("%H:%M:%S", time.localtime(float(e.get("time") or 0)))
        client = str(e.get("client") or "—")
        tokens = f"{int(e.get('prompt_tokens') or 0):,} → {int(e.get('completion_tokens') or 0):,}"
        speed = float(e.get("decode_tokens_per_s") or 0.0)
        rows.append((when, client, tokens, f"{speed:,.1f} tok/s" if speed else "—", str(e.get("finish_reason") or "")))
    return rows


class ServerPanel(QWidget):
    """The panel's widgets over a :class:`desktop.remote.serve_toggle.ServeToggle` (``toggle``)."""

    def __init__(self, toggle, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("serverPanel")
        self.toggle, self.settings = toggle, toggle.window.settings
        self.state = QLabel()
        self.state.setObjectName("serverState")
        self.state.setWordWrap(True)
        self.address = QLineEdit()
        self.address.setReadOnly(True)
        self.address.setObjectName("serverAddress")
        self.copy_address = QPushButton("Copy")
        self.copy_address.clicked.connect(lambda: self._copy(self.address.text(), "the address"))
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("chosen at the first start")
        self.port.setToolTip("Kept for every start, so a client set up once keeps working; applies at the next start")
        self.port.setValue(int(self.settings.get("server/port") or 0))
        self.port.valueChanged.connect(lambda v: self.settings.set("server/port", int(v)))
        self.require_key = QCheckBox("Clients must send an API key")
        self.require_key.setChecked(bool(self.settings.get("server/require_key")))
        self.require_key.toggled.connect(self._key_choice)
        self.key = QLineEdit()
        self.key.setObjectName("serverKey")
        self.key.setReadOnly(True)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_key = QPushButton("Show")
        self.show_key.setCheckable(True)
        self.show_key.toggled.connect(lambda on: (self.key.setEchoMode(
            QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password), self.show_key.setText("Hide" if on else "Show")))
        self.copy_key = QPushButton("Copy")
        self.copy_key.clicked.connect(lambda: self._copy(self.key.text(), "the API key"))
        self.table = QTableWidget(0, len(LOG_COLUMNS))
        self.table.setObjectName("serverLog")
        self.table.setHorizontalHeaderLabels(list(LOG_COLUMNS))
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)

        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.mode = QLabel()
        self.mode.setObjectName("serverMode")
        self.mode.setWordWrap(True)
        self.pool_bar = PoolBar()
        self.pool_text = QLabel()
        self.pool_text.setObjectName("serverPool")
        self.pool_text.setWordWrap(True)
        form.addRow(self.state)
        form.addRow(self.mode)
        form.addRow(self.pool_bar)
        form.addRow(self.pool_text)
        # The address across the panel, under its label and Copy: beside them a 240 px panel
        # showed "0.0.1:58869/v1", the end of the address without its start.
        form.addRow("Address", _row(QWidget(), self.copy_address))
        form.addRow(self.address)
        form.addRow("Port", self.port)
        form.addRow(self.require_key)
        # The key on a row of its own: beside its buttons a 265 px panel showed 7 of its characters.
        form.addRow("API key", self.key)
        form.addRow("", _row(QWidget(), self.show_key, self.copy_key))
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(QLabel("Requests (newest first)"))
        lay.addWidget(self.table, 1)

        self._net = QNetworkAccessManager(self)
        self._poll = QTimer(self, interval=POLL_MS)
        self._poll.timeout.connect(self.refresh)
        toggle.changed.connect(lambda *_: self.sync())
        self.settings.changed.connect(self._on_setting)
        self.sync()

    # ---- what it shows -------------------------------------------------------------------
    def sync(self) -> None:
        s = self.toggle.server
        port = int(self.settings.get("server/port") or 0)
        if s.state == "serving":
            where = (" from this window's model (no second copy of its weights)" if s.in_process
                     else " in a second process (its own copy of the weights)")
            self.state.setText(f"Serving {s.model_id} on {s.device}{where}: any OpenAI client can use the address "
                               + ("with the API key below." if s.api_key else "(loopback only, no key)."))
            self.address.setText(s.url)
            self._poll.start()
        else:
            starting = ("Starting: the server shares this window's model…" if s.in_process
                        else "Starting: the server loads its own copy of the model…")
            words = {"starting": starting,
                     "failed": f"Not serving: {s.error}"}.get(s.state, "Not serving. Server > Serve the loaded model starts it.")
            self.state.setText(words)
            self.address.setText(f"http://127.0.0.1:{port}/v1" if port else "")
            self._poll.stop()
            self.show_pool({})
        self.address.setCursorPosition(0)   # read from its start when it is cut
        self.copy_address.setEnabled(bool(self.address.text()))
        on = self.require_key.isChecked()
        self.key.setText(self.toggle.api_key() if on else "")
        for w in (self.key, self.show_key, self.copy_key):
            w.setEnabled(on)
        if s.running and on != bool(s.api_key):
            self.state.setText(self.state.text() + " The key choice applies at the next start.")

    def show_pool(self, stats: dict) -> None:
        """How the server runs requests and its page pool, from a ``/v1/attnchat/stats`` answer
        (``{}``: not serving, nothing shown)."""
        segments = pool_segments(stats)
        self.mode.setText(mode_text(stats, self.toggle.server._lines) if stats else "")
        self.mode.setVisible(bool(stats))
        self.pool_bar.set_segments(segments)
        self.pool_bar.setVisible(bool(segments))
        self.pool_text.setText(pool_summary(stats))
        self.pool_text.setVisible(bool(segments))

    def show_stats(self, stats: dict) -> None:
        """Fill the request log and the pool from a ``/v1/attnchat/stats`` answer."""
        self.show_pool(stats)
        rows = log_rows(stats)
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                item = QTableWidgetItem(text)
                if c in (2, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(r, c, item)

    # ---- reading the log -----------------------------------------------------------------
    def refresh(self) -> None:
        s = self.toggle.server
        if s.state != "serving" or not s.url:
            return
        req = QNetworkRequest(QUrl(s.url.rstrip("/") + "/attnchat/stats"))
        if s.api_key:
            req.setRawHeader(b"Authorization", f"Bearer {s.api_key}".encode())
        reply = self._net.get(req)
        reply.finished.connect(lambda r=reply: self._answered(r))

    def _answered(self, reply: QNetworkReply) -> None:
        try:
            if reply.error() != QNetworkReply.NetworkError.NoError:
                log.debug("server stats: %s", reply.errorString())
                return
            self.show_stats(json.loads(bytes(reply.readAll().data()) or b"{}"))
        except (ValueError, TypeError):
            log.debug("server stats unreadable", exc_info=True)
        finally:
            reply.deleteLater()

    # ---- choices -------------------------------------------------------------------------
    def _key_choice(self, on: bool) -> None:
        self.settings.set("server/require_key", bool(on))
        self.sync()

    def _on_setting(self, key: str, value) -> None:
        if key == "server/port" and int(value or 0) != self.port.value():
            self.port.blockSignals(True)
            self.port.setValue(int(value or 0))
            self.port.blockSignals(False)
        if key.startswith("server/"):
            self.sync()

    def _copy(self, text: str, what: str) -> None:
        if text:
            QGuiApplication.clipboard().setText(text)
            self.toggle.window.status.showMessage(f"Copied {what}", 3000)


def _row(*widgets: QWidget) -> QWidget:
    w = QWidget()
    h = QHBoxLayout(w)
    h.setContentsMargins(0, 0, 0, 0)
    for i, x in enumerate(widgets):
        h.addWidget(x, 1 if i == 0 else 0)
    return w


def install(window, toggle) -> ServerPanel:
    """The Server panel as a dock of ``window`` (hidden until View > Server or Server > Server panel)."""
    panel = ServerPanel(toggle)
    dock = QDockWidget("Server", window)
    dock.setObjectName("serverDock")
    scroll = QScrollArea()   # a short dock scrolls: squeezed, its first rows were cut off (1100 x 720)
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QScrollArea.Shape.NoFrame)
    scroll.setWidget(panel)
    dock.setWidget(scroll)
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    dock.hide()

    def shown(visible: bool) -> None:
        # A tab beside a panel already on the right (split below it, both were too short).
        if visible and not window.tabifiedDockWidgets(dock):
            beside = [d for d in window.findChildren(QDockWidget) if d is not dock and d.isVisible()
                      and window.dockWidgetArea(d) == Qt.DockWidgetArea.RightDockWidgetArea]
            if beside:
                window.tabifyDockWidget(beside[0], dock)
        if visible:
            dock.raise_()
    dock.visibilityChanged.connect(shown)
    act = dock.toggleViewAction()
    act.setText("&Server panel")
    toggle.menu.addSeparator()
    toggle.menu.addAction(act)
    window.view_menu.addAction(act)
    panel.dock = dock
    return panel
