"""The main window: conversations (left), the chat (centre), dockable panels (right).

It owns no model: requests go to an :class:`desktop.worker.Engine`, replies come back
as signals. The database is the truth for every conversation; the window saves each
user message as it is sent and each reply when it finishes or is stopped. Must not
import torch or runtime.
"""
from __future__ import annotations

import json
import logging
import sqlite3
from typing import Callable

from PySide6.QtCore import QCoreApplication, QEvent, QRect, Qt, Signal
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import QDockWidget, QFileDialog, QMainWindow, QMessageBox, QSplitter, QStackedWidget, QWidget

import models
from desktop.chat.conversations import ConversationListModel, ConversationPanel
from desktop.chat.pages import ASK, ChatPage, EmptyState
from desktop.chat.status_bar import ChatStatusBar
from desktop.chat.store import Store
from desktop.chat.view import MessageListModel
from desktop.main_window.attach import Attachments
from desktop.main_window.conversations import ConversationActions
from desktop.main_window.panel_width import PanelWidthGuard
from desktop.main_window.replies import ReplyActions
from desktop.main_window.token_count import TokenCounter
from desktop.remote.client import source_label
from desktop.settings.checks import CONTEXT_KEYS, effective_context
from desktop.settings.values import Settings
from desktop.worker import Engine, model_key

__all__ = ["MainWindow", "PANEL_SLOTS"]

log = logging.getLogger(__name__)

#: The panels other modules add with :meth:`MainWindow.add_panel` (object name -> title).
PANEL_SLOTS = {"kvCachePanel": "KV-cache memory", "attentionPanel": "Attention"}

#: A dock panel's starting width at least (px): its charts and tabs stay readable.
PANEL_MIN_WIDTH = 270
#: Room left around a new window for the window manager's frame (title bar, borders), which
#: is unknown before the window is shown (pixels: width, height).
FRAME_ROOM = (16, 48)


class MainWindow(ConversationActions, ReplyActions, QMainWindow):
    """The chat window (conversations and replies in their mixins).

    Args:
        store: the conversation database.
        settings: the app's settings.
        engine: the engine (its thread is shut down when the window closes).
        confirm: ``(question) -> bool`` for destructive actions (default: a message box).
    """

    reply_finished = Signal(object)   # the worker's finished dict, after it is saved
    stats_updated = Signal(object)    # every stats dict of the open conversation's reply (for panels)
    # A conversation was opened, or a model loaded: its last reply's stats ({}: none yet;
    # {"other_model": True}: its last reply came from another model, so none apply).
    conversation_stats = Signal(object)
    model_changed = Signal(object)    # the loaded model's info dict
    download_requested = Signal()

    def __init__(self, store: Store, settings: Settings, engine: Engine, *,
                 confirm: Callable[[str], bool] | None = None, parent=None):
        super().__init__(parent)
        self.setObjectName("mainWindow")
        self.setWindowTitle("attnchat")
        self.store, self.settings, self.engine = store, settings, engine
        self.confirm = confirm or (lambda q: QMessageBox.question(self, "attnchat", q) == QMessageBox.StandardButton.Yes)
        self.generation_overrides: dict = {}
        self._conv_id = 0
        self._reply: dict | None = None
        self._editing = 0   # the id of the message being edited, or 0
        self._closed = False
        self._model_source = ""
        self._kept_source = ""   # the source of the model a failed load keeps
        self._models_loaded = 0   # in this window; stored figures without a model key fit only the first
        # Replies the database refused (disk full): shown, and saved again before the next write.
        self._unsaved: list[dict] = []
        # Conversations whose cache the worker holds now (a reply in this run): their cache key then.
        self._live: dict[int, tuple] = {}
        self.panels: dict[str, QDockWidget] = {}

        self.conversations = ConversationListModel(store, self)
        self.sidebar = ConversationPanel(self.conversations)
        self.messages = MessageListModel(self)
        self._build_chat()
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.stack)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.sidebar.setMinimumWidth(170)  # titles stay readable when the docks take the width
        self.splitter.setSizes([230, 770])
        self.setCentralWidget(self.splitter)
        self.panel_width = PanelWidthGuard(self, self.stack)   # the docks leave the chat half the window
        self.setStatusBar(status := ChatStatusBar())
        self.status = status
        self._build_menus()
        self._connect()
        self.attachments = Attachments(self)   # files in the next message (before the counter: it counts them)
        self.token_counter = TokenCounter(self)
        self.resize(1100, 720)
        self._restore()
        self._sync()

    # ---- construction --------------------------------------------------------------------
    def _build_chat(self) -> None:
        self.page = ChatPage()
        p = self.page
        self.chat, self.input, self.notice, self.edit_banner = p.chat, p.input, p.notice, p.edit_banner
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.notice.linkActivated.connect(self._on_notice_link)
        self._sent: dict | None = None   # the last message sent, and what taking it back restores
        self.send_button, self.stop_button = p.send_button, p.stop_button
        self.regen_button, self.edit_button = p.regen_button, p.edit_button
        self.chat.setModel(self.messages)
        self.empty = EmptyState()
        self.empty_download, self.empty_open = self.empty.download_button, self.empty.open_button
        self.stack = QStackedWidget()
        self.stack.addWidget(self.page)
        self.stack.addWidget(self.empty)

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
        act = menu.addAction(text)
        act.triggered.connect(slot)
        if shortcut is not None:
            act.setShortcut(QKeySequence(shortcut))
        return act

    def add_file_action(self, action: QAction) -> None:
        """Put ``action`` in the File menu right after "Open model folder…" (at the end when
        that item is missing): where the model and server entries of add-ons belong."""
        actions = self.file_menu.actions()
        after = getattr(self, "open_folder_action", None)
        at = actions.index(after) + 1 if after in actions else len(actions)
        if at < len(actions):
            self.file_menu.insertAction(actions[at], action)
        else:
            self.file_menu.addAction(action)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        f = self.file_menu = bar.addMenu("&File")
        self._action(f, "&New chat", self.new_conversation, QKeySequence.StandardKey.New)
        self._action(f, "&Open model…", self.open_model_file, QKeySequence.StandardKey.Open)
        self.open_folder_action = self._action(f, "Open model &folder…", self.open_model_folder)
        self._action(f, "&Download the default model…", self.download_requested.emit)
        f.addSeparator()
        self.export_md = self._action(f, "Export as &Markdown…", lambda: self.export_dialog(self._conv_id, "markdown"))
        self.export_json = self._action(f, "Export as &JSON…", lambda: self.export_dialog(self._conv_id, "json"))
        f.addSeparator()
        self._action(f, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        e = bar.addMenu("&Edit")
        self.copy_action = self._action(e, "&Copy message", lambda: self.chat.copy_row(self.chat.selected_row()))
        self.regen_action = self._action(e, "&Regenerate", self.regenerate, "Ctrl+R")
        self.edit_action = self._action(e, "&Edit last message", self.edit_last, "Ctrl+E")
        self._action(e, "&Attach files to the message…", lambda: self.attachments.choose(), "Ctrl+Shift+A")
        self.stop_action = self._action(e, "&Stop", self.stop)
        self._action(e, "Re&name chat", lambda: self._conv_id and self.sidebar.rename(self._conv_id), "F2")
        v = bar.addMenu("&View")
        self.view_menu = v
        side = self._action(v, "&Conversations", lambda on: self.sidebar.setVisible(on))
        side.setCheckable(True)
        side.setChecked(True)
        v.addSeparator()
        self.panel_actions: dict[str, QAction] = {}
        for name, title in PANEL_SLOTS.items():
            act = v.addAction(f"{title} (not available yet)")
            act.setEnabled(False)
            self.panel_actions[name] = act

    def _connect(self) -> None:
        sb = self.sidebar
        sb.selected.connect(self.open_conversation)
        sb.new_requested.connect(self.new_conversation)
        sb.delete_requested.connect(self.delete_conversation)
        sb.export_requested.connect(self.export_dialog)
        self.conversations.dataChanged.connect(self._update_title)
        self.input.submitted.connect(self.submit)
        self.input.cancelled.connect(lambda: self.cancel_edit() if self._editing else self.stop())
        self.send_button.clicked.connect(self.input.submit)
        self.stop_button.clicked.connect(self.stop)
        self.regen_button.clicked.connect(self.regenerate)
        self.edit_button.clicked.connect(self.edit_last)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.chat.edit_requested.connect(self.edit_message)
        self.chat.stop_requested.connect(self.stop)
        self.chat.branch_requested.connect(self.show_branch)
        self.chat.seed_requested.connect(self.use_seed)
        self.chat.copied.connect(lambda what: self.status.showMessage(
            "Copied the code block" if what == "code" else "Copied the message", 3000))
        self.empty_download.clicked.connect(self.download_requested.emit)
        self.empty_open.clicked.connect(self.open_model_file)
        self.settings.changed.connect(self._on_setting)
        en = self.engine
        en.model_loaded.connect(self._on_model_loaded)
        en.load_failed.connect(self._on_load_failed)
        en.text_batch.connect(self._on_text)
        en.prefill_progress.connect(self._on_prefill)
        en.stats.connect(self._on_stats)
        en.error.connect(self.show_error)
        en.finished.connect(self._on_finished)

    def fit_to_screen(self, room: QRect | None = None) -> None:
        """Shrink a new user's window (the default 1,100 x 720) to fit ``room`` (the screen's
        available area) with its frame: on a 720 px screen the title bar pushed the status bar
        below the screen's edge. A restored geometry is already fitted (Qt's restoreGeometry)."""
        if self.restored_geometry:
            return
        if room is None:
            screen = self.screen() or QGuiApplication.primaryScreen()
            if screen is None:
                return
            room = screen.availableGeometry()
        w, h = min(self.width(), room.width() - FRAME_ROOM[0]), min(self.height(), room.height() - FRAME_ROOM[1])
        if (w, h) != (self.width(), self.height()):
            self.resize(max(w, self.minimumWidth()), max(h, self.minimumHeight()))

    def _restore(self) -> None:
        s = self.settings
        #: True when the window took a saved geometry (not a new user's default size).
        self.restored_geometry = not s.get("window/geometry").isEmpty()
        if self.restored_geometry:
            self.restoreGeometry(s.get("window/geometry"))
        if not s.get("window/state").isEmpty():
            self.restoreState(s.get("window/state"))
        if not s.get("window/splitter").isEmpty():
            self.splitter.restoreState(s.get("window/splitter"))
        try:
            widths = json.loads(s.get("window/panel_widths") or "{}")
        except ValueError:
            widths = {}
        self._panel_widths = {k: int(v) for k, v in widths.items() if isinstance(v, (int, float))} \
            if isinstance(widths, dict) else {}
        last = s.get("last_conversation")
        if last and self.conversations.row_of(last) >= 0:
            self.open_conversation(last)
        elif self.conversations.rowCount():
            self.open_conversation(self.conversations.index(0).data(ConversationListModel.IdRole))

    # ---- panels (their own issues) ---------------------------------------------------------
    def add_panel(self, name: str, title: str, widget: QWidget, *, visible: bool = True) -> QDockWidget:
        """Dock ``widget`` on the right with a View menu entry; ``name`` is its object name.

        Where the saved window state knows the panel, it comes back where and as it was;
        otherwise it is docked on the right, shown or closed as ``visible`` says.
        """
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        # restoreState() ran before the panels existed; restoreDockWidget() applies it now
        # (it must come before addDockWidget, which would otherwise win).
        if not self.restoreDockWidget(dock):
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
            # The chat keeps the middle and most of the width (as in LM Studio, Jan, GPT4All):
            # a new panel starts at about a quarter of the window, resizable and remembered.
            self.resizeDocks([dock], [max(PANEL_MIN_WIDTH, self.width() * 26 // 100)], Qt.Orientation.Horizontal)
            if not visible:
                dock.hide()
        old = self.panel_actions.pop(name, None)
        act = dock.toggleViewAction()
        self.view_menu.insertAction(old, act) if old else self.view_menu.addAction(act)
        if old:
            self.view_menu.removeAction(old)
        self.panels[name] = dock
        self.panel_width.watch(dock, self._panel_widths.get(name))
        return dock

    # ---- models ------------------------------------------------------------------------------
    def load_model(self, source: str = "") -> None:
        """Load a model on the worker (``""``: the default model); the window stays responsive.

        A reply being written is stopped first (and saved as stopped, like any other).
        """
        if self._reply is not None:
            self.engine.stop()
        if self.engine.model:   # what a failed load goes back to
            self._kept_source = self._model_source
        self._model_source = source
        self.notice.hide()
        self.status.set_loading(source_label(source))
        self.chat.placeholder = "Loading the model…"
        self.stack.setCurrentIndex(0)
        self.engine.load(source, self.settings.get("model/device"))
        self._sync()

    @staticmethod
    def models_folder() -> str:
        """Where File > Open model… starts: the models folder (:func:`models.models_dir`, where
        downloads go); "" (the current folder) when it cannot be made."""
        try:
            return str(models.models_dir())
        except OSError:
            return ""

    def open_model_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a model file", self.models_folder(),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def open_model_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a model folder (config.json + safetensors)",
                                                self.models_folder())
        if path:
            self.load_model(path)

    def show_first_run(self) -> None:
        """The empty state: no model installed yet."""
        self.stack.setCurrentWidget(self.empty)
        self.status.set_model(None)
        self._sync()

    def _on_model_loaded(self, info: dict) -> None:
        self.settings.use_model(model_key(info))   # its own context, prompt, sampling, cache policy
        self._models_loaded += 1
        self._live.clear()   # a load starts with no sessions
        self.status.set_model(info, self.context_limit())
        self.chat.placeholder = ASK
        self.stack.setCurrentIndex(0)
        self.settings.set("model/source", self._model_source)
        notices = " ".join(info.get("notices") or ())  # a device fallback, a plain chat format (EngineWorker.load_model)
        if notices:  # before model_changed: the settings' resets it brings are added after them, not lost
            self.show_note(notices)
        self.model_changed.emit(info)      # the panels take the new model first,
        self._show_context_of(self._conv_id)   # then the open conversation's figures,
        # and then the message: sized against the fields as they now are (shown before them, a
        # restart's "Loaded SmolLM2-135M-Instruct.Q4_1 in" lost its time behind the last reply's figures)
        if info.get("remote"):
            self.status.showMessage(f"Connected to {info['device'].removeprefix('server ')}", 5000)
        else:
            self.status.showMessage(f"Loaded {info['name']} in {info.get('load_seconds', 0):.1f} s", 5000)
        if notices:
            self.status.showMessage(self.notice.text(), 10000)
        self._sync()
        self.input.setFocus()

    def context_limit(self) -> int:
        """The context limit a new reply gets (tokens; 0: no model): a server's own, else the
        settings' capped by the model and the cache memory limit (:func:`effective_context`).
        The status bar and the KV-cache panel show this until a reply reports its own."""
        model = self.engine.model
        if model and model.get("remote"):
            return int(model.get("context_limit") or 0)
        gen = self.generation()   # the settings and this window's overrides, as a reply gets them
        return effective_context({k: gen.get(k.split("/", 1)[1]) for k in CONTEXT_KEYS}, model)

    def _on_setting(self, key: str, value) -> None:
        if key in CONTEXT_KEYS:
            self.status.set_default_limit(self.context_limit())
            if self.engine.model:
                self._show_context_of(self._conv_id)   # a new cache comes with the next reply

    def _on_load_failed(self, message: str) -> None:
        kept = self.engine.model   # the model loaded before, still there (Engine keeps it)
        if kept:
            self._model_source = self._kept_source
            self.status.set_model(kept, self.context_limit())
            self.chat.placeholder = ASK
            self._show_context_of(self._conv_id)
            self.show_error(f"Could not load the model: {message}. Still using {kept.get('name', 'the model loaded before')}.")
        else:
            self.status.set_model(None)
            self.show_error(f"Could not load the model: {message}")
            self.chat.placeholder = "No model is loaded. Use File > Open model, or download the default model."
        self.chat.viewport().update()
        self._sync()

    def _on_notice_link(self, link: str) -> None:
        self.notice.hide()
        if link == "new":
            self.new_conversation()
        elif link == "overflow":
            self.settings.set("generation/overflow", "truncate-middle")
            self.status.showMessage("Overflow policy: truncate-middle (the oldest turns are dropped); "
                                    "send the message again", 8000)
        self.input.setFocus()

    def show_note(self, message: str) -> None:
        """A line the user should read that is not an error (pale yellow, not red)."""
        self.page.set_notice_kind("note")
        self.notice.setText(message)
        self.notice.show()

    def show_error(self, message: str) -> None:
        """One line for the user, in the window (never a traceback)."""
        self.page.set_notice_kind("error")
        self.notice.setText(message)
        self.notice.show()
        self.status.showMessage(message, 10000)

    def _sync(self) -> None:
        """Enable what can be done now."""
        busy = self._reply is not None
        ready = bool(self.engine.model) and not busy
        has_user = self.messages.last_row("user") >= 0
        self.chat.busy = busy
        self.send_button.setVisible(not busy)
        self.send_button.setEnabled(ready)
        self.stop_button.setVisible(busy)
        self.stop_action.setEnabled(busy)
        for w in (self.regen_button, self.regen_action):
            w.setEnabled(ready and has_user and not self._editing)
        for w in (self.edit_button, self.edit_action):
            w.setEnabled(not busy and has_user and not self._editing)
        for w in (self.export_md, self.export_json):
            w.setEnabled(bool(self._conv_id))

    # ---- closing -------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802
        if not self._closed:
            self._closed = True
            s = self.settings
            s.set("window/geometry", self.saveGeometry())
            s.set("window/state", self.saveState())
            s.set("window/splitter", self.splitter.saveState())
            s.set("window/panel_widths", json.dumps(self.panel_width.widths(), sort_keys=True))
            s.sync()
            self.hide()
            # Stop the reply, end the thread, then deliver what it sent last so the
            # stopped reply is saved like any other.
            self.engine.shutdown()
            QCoreApplication.sendPostedEvents(self.engine, QEvent.Type.MetaCall.value)
            try:
                self._save_unsaved()
            except (sqlite3.Error, OSError):   # the last resort: the text is in the log file
                for u in self._unsaved:
                    log.error("reply not saved (conversation %s): %r", u["conv_id"], u["text"])
        super().closeEvent(event)
