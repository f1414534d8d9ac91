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
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QDockWidget, QMainWindow, QMessageBox, QSplitter, QStackedWidget, QWidget

from desktop.chat.conversations import ConversationListModel, ConversationPanel
from desktop.chat.pages import ASK, ChatPage, EmptyState
from desktop.chat.status_bar import ChatStatusBar
from desktop.chat.store import Store
from desktop.chat.view import MessageListModel
from desktop.main_window.attach import Attachments
from desktop.main_window.conversations import ConversationActions
from desktop.main_window.menus import build_menus
from desktop.main_window.panel_width import PanelWidthGuard
from desktop.main_window.replies import LOADING_NOTE, ReplyActions
from desktop.main_window import model_files
from desktop.main_window.notices import sentence
from desktop.main_window.token_count import TokenCounter
from desktop.remote.client import source_label
from desktop.settings.checks import CONTEXT_KEYS, effective_context
from desktop.settings.values import Settings
from desktop.worker import Engine, model_key

__all__ = ["MainWindow", "PANEL_SLOTS"]

log = logging.getLogger(__name__)

#: The panels other modules add with :meth:`MainWindow.add_panel` (object name -> title). Short
#: titles: tabbed together with the Server panel in an 1100 px window, "KV-cache memory" was cut
#: to "KV-cache me…" and the others to "Atten…" and "Se…".
PANEL_SLOTS = {"kvCachePanel": "KV cache", "attentionPanel": "Attention"}

#: A dock panel's starting width at least (px): its charts and tabs stay readable.
PANEL_MIN_WIDTH = 270
#: Room left around a new window for the window manager's frame (title bar, borders), which
#: is unknown before the window is shown (pixels: width, height).
FRAME_ROOM = (16, 48)


class MainWindow(QMainWindow):
    """The chat window. It owns its parts: ``chats`` (:class:`ConversationActions`: open,
    create, delete, export, save) and ``replies`` (:class:`ReplyActions`: send, edit, regenerate,
    stop, the streamed reply); the methods below them are what other modules and tests call.

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
        self._closed = False
        self._model_source = ""
        self._kept_source = ""   # the source of the model a failed load keeps
        self._models_loaded = 0   # in this window; stored figures without a model key fit only the first
        self.panels: dict[str, QDockWidget] = {}
        self.chats = ConversationActions(self)
        self.replies = ReplyActions(self)

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
        build_menus(self, PANEL_SLOTS)
        self._connect()
        self.attachments = Attachments(self)   # files in the next message (before the counter: it counts them)
        self.token_counter = TokenCounter(self)
        self.resize(1100, 720)
        self._restore()
        self._sync()
        self.input.setFocus()   # typing goes to the message box from the start, not to "Search chats"

    # ---- construction --------------------------------------------------------------------
    def _build_chat(self) -> None:
        self.page = ChatPage()
        p = self.page
        self.chat, self.input, self.notice, self.edit_banner = p.chat, p.input, p.notice, p.edit_banner
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.notice.linkActivated.connect(self._on_notice_link)
        self.send_button, self.stop_button = p.send_button, p.stop_button
        self.regen_button, self.edit_button = p.regen_button, p.edit_button
        self.chat.setModel(self.messages)
        self.empty = EmptyState()
        self.empty_download, self.empty_open = self.empty.download_button, self.empty.open_button
        self.stack = QStackedWidget()
        self.stack.addWidget(self.page)
        self.stack.addWidget(self.empty)

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

    def _connect(self) -> None:
        sb = self.sidebar
        chats, replies = self.chats, self.replies
        sb.selected.connect(chats.open)
        sb.new_requested.connect(chats.new)
        sb.delete_requested.connect(chats.delete)
        sb.export_requested.connect(chats.export_dialog)
        self.conversations.dataChanged.connect(chats.update_title)
        self.input.submitted.connect(replies.submit)
        self.input.cancelled.connect(lambda: replies.cancel_edit() if replies.editing else replies.stop())
        self.send_button.clicked.connect(self.input.submit)
        self.stop_button.clicked.connect(replies.stop)
        self.regen_button.clicked.connect(replies.regenerate)
        self.edit_button.clicked.connect(replies.edit_last)
        self.chat.regenerate_requested.connect(replies.regenerate)
        self.chat.edit_requested.connect(replies.edit_message)
        self.chat.stop_requested.connect(replies.stop)
        self.chat.branch_requested.connect(replies.show_branch)
        self.chat.seed_requested.connect(replies.use_seed)
        self.chat.copied.connect(lambda what: self.status.showMessage(
            "Copied the code block" if what == "code" else "Copied the message", 3000))
        self.empty_download.clicked.connect(self.download_requested.emit)
        self.empty_open.clicked.connect(self.open_model_file)
        self.settings.changed.connect(self._on_setting)
        en = self.engine
        en.model_loaded.connect(self._on_model_loaded)
        en.load_failed.connect(self._on_load_failed)
        en.text_batch.connect(replies.on_text)
        en.prefill_progress.connect(replies.on_prefill)
        en.stats.connect(replies.on_stats)
        en.error.connect(self.show_error)
        en.finished.connect(replies.on_finished)

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
            self.chats.open(last)
        elif self.conversations.rowCount():
            self.chats.open(self.conversations.index(0).data(ConversationListModel.IdRole))

    # ---- what other modules ask of the window (the parts do it) -------------------------------
    @property
    def current_conversation(self) -> int:
        """The open conversation's id (0: none)."""
        return self.chats.current

    def new_conversation(self) -> int:
        """Open a new conversation (the open one when it is still empty); its id."""
        return self.chats.new()

    def open_conversation(self, conv_id: int) -> None:
        self.chats.open(conv_id)

    def delete_conversation(self, conv_id: int) -> None:
        """Delete ``conv_id`` after asking (``confirm``)."""
        self.chats.delete(conv_id)

    def export_conversation(self, conv_id: int, fmt: str, path) -> None:
        """Write ``conv_id`` to ``path`` as ``"markdown"`` or ``"json"`` (raises OSError)."""
        self.chats.export(conv_id, fmt, path)

    def export_dialog(self, conv_id: int, fmt: str) -> None:
        self.chats.export_dialog(conv_id, fmt)

    def generation(self) -> dict:
        """Every generation setting a reply gets (:meth:`ReplyActions.generation`)."""
        return self.replies.generation()

    def reply_generation(self) -> dict:
        return self.replies.reply_generation()

    def submit(self, text: str) -> None:
        """Send ``text`` (or the edit being made) as the user would (:meth:`ReplyActions.submit`)."""
        self.replies.submit(text)

    def regenerate(self) -> None:
        self.replies.regenerate()

    def edit_message(self, row: int) -> None:
        self.replies.edit_message(row)

    def show_branch(self, row: int, step: int) -> None:
        self.replies.show_branch(row, step)

    def stop(self) -> None:
        """Stop the reply being written (it is saved as stopped)."""
        self.replies.stop()

    @property
    def replying(self) -> bool:
        """Whether a reply is being written."""
        return self.replies.reply is not None

    # ---- panels (added by other modules) ------------------------------------------------------
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
        if self.replies.reply is not None:
            self.engine.stop()
        if self.engine.model:   # what a failed load goes back to
            self._kept_source = self._model_source
        self._model_source = source
        self.hide_notice()
        self.status.set_loading(source_label(source))
        self.chat.placeholder = "Loading the model…"
        self.stack.setCurrentIndex(0)
        self.engine.load(source, self.settings.get("model/device"))
        self._sync()

    def open_model_file(self) -> None:
        model_files.open_file(self)

    def open_model_folder(self) -> None:
        model_files.open_folder(self)

    def show_first_run(self) -> None:
        """The empty state: no model installed yet."""
        self.stack.setCurrentWidget(self.empty)
        self.status.set_model(None)
        self._sync()

    def _on_model_loaded(self, info: dict) -> None:
        if self.notice.text() == LOADING_NOTE:   # Enter was pressed while it loaded: it sends now
            self.hide_notice()
        self.settings.use_model(model_key(info))   # its own context, prompt, sampling, cache policy
        self._models_loaded += 1
        self.chats.live.clear()   # a load starts with no sessions
        self.status.set_model(info, self.context_limit())
        self.chat.placeholder = ASK
        self.stack.setCurrentIndex(0)
        self.settings.set("model/source", self._model_source)
        notices = " ".join(info.get("notices") or ())  # a device fallback, a plain chat format (EngineWorker.load_model)
        if notices:  # before model_changed: the settings' resets it brings are added after them, not lost
            self.show_note(notices)
        self.model_changed.emit(info)      # the panels take the new model first,
        self.chats.show_context_of(self.chats.current)   # then the open conversation's figures,
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
                self.chats.show_context_of(self.chats.current)   # a new cache comes with the next reply

    def _on_load_failed(self, message: str) -> None:
        kept = self.engine.model   # the model loaded before, still there (Engine keeps it)
        if kept:
            self._model_source = self._kept_source
            self.status.set_model(kept, self.context_limit())
            self.chat.placeholder = ASK
            self.chats.show_context_of(self.chats.current)
            self.show_error(f"Could not load the model: {message}. Still using {kept.get('name', 'the model loaded before')}.")
        else:
            self.status.set_model(None)
            self.show_error(f"Could not load the model: {message}")
            self.chat.placeholder = "No model is loaded. Use File > Open model, or download the default model."
        self.chat.viewport().update()
        self._sync()

    def _on_notice_link(self, link: str) -> None:
        self.hide_notice()
        if link == "new":
            self.chats.new()
        elif link == "overflow":
            self.settings.set("generation/overflow", "truncate-middle")
            self.status.showMessage("Overflow policy: truncate-middle (the oldest turns are dropped); "
                                    "send the message again", 8000)
        self.input.setFocus()

    def show_note(self, message: str) -> None:
        """A line the user should read that is not an error (pale yellow, not red)."""
        message = sentence(message)
        self.page.set_notice_kind("note")
        self.notice.setText(message)
        self.notice.show()

    def hide_notice(self) -> None:
        """Hide the notice line, and the status bar's copy of it (:meth:`show_error` leaves one
        there for 10 s): what it said is over (a new reply, a load, another conversation)."""
        if self.notice.text() and self.status.currentMessage() == self.notice.text():
            self.status.clearMessage()
        self.notice.hide()

    def show_error(self, message: str) -> None:
        """One line for the user, in the window (never a traceback); it starts as a sentence."""
        message = sentence(message)
        self.page.set_notice_kind("error")
        self.notice.setText(message)
        self.notice.show()
        self.status.showMessage(message, 10000)

    def _sync(self) -> None:
        """Enable what can be done now."""
        busy, editing = self.replies.reply is not None, self.replies.editing
        ready = bool(self.engine.model) and not busy
        has_user = self.messages.last_row("user") >= 0
        self.chat.busy = busy
        self.send_button.setVisible(not busy)
        self.send_button.setEnabled(ready)
        self.stop_button.setVisible(busy)
        self.stop_action.setEnabled(busy)
        for w in (self.regen_button, self.regen_action):
            w.setEnabled(ready and has_user and not editing)
        for w in (self.edit_button, self.edit_action):
            w.setEnabled(not busy and has_user and not editing)
        for w in (self.export_md, self.export_json):
            w.setEnabled(bool(self.chats.current))

    # ---- closing -------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802
        if not self._closed:
            self._closed = True
            s = self.settings
            s.set("window/geometry", self.saveGeometry())
            s.set("window/state", self.saveState())
            s.set("window/splitter", self.splitter.saveState())
            s.set("window/panel_widths", json.dumps(self.panel_width.widths(), sort_keys=True))
            self.chats.save_drafts()
            s.sync()
            self.hide()
            # Stop the reply, end the thread, then deliver what it sent last so the
            # stopped reply is saved like any other.
            self.engine.shutdown()
            QCoreApplication.sendPostedEvents(self.engine, QEvent.Type.MetaCall.value)
            try:
                self.chats.save_unsaved()
            except (sqlite3.Error, OSError):   # the last resort: the text is in the log file
                for u in self.chats.unsaved:
                    log.error("reply not saved (conversation %s): %r", u["conv_id"], u["text"])
        super().closeEvent(event)
