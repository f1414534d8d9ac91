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
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QCoreApplication, QEvent, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QDockWidget, QFileDialog, QMainWindow, QMessageBox, QSplitter, QStackedWidget, QWidget

from desktop.chat.view import MessageListModel
from desktop.chat.conversations import ConversationListModel, ConversationPanel
from desktop.chat.pages import ASK, ChatPage, EmptyState
from desktop.remote.client import source_label
from desktop.settings.values import Settings
from desktop.chat.status_bar import ChatStatusBar
from desktop.chat.store import DEFAULT_TITLE, Store
from desktop.worker import Engine

__all__ = ["MainWindow", "PANEL_SLOTS"]

log = logging.getLogger(__name__)

#: The panels other modules add with :meth:`MainWindow.add_panel` (object name -> title).
PANEL_SLOTS = {"kvCachePanel": "KV-cache memory", "attentionPanel": "Attention"}
TITLE_CHARS = 48


#: A dock panel's starting width at least (px): its charts and tabs stay readable.
PANEL_MIN_WIDTH = 270


class MainWindow(QMainWindow):
    """The chat window.

    Args:
        store: the conversation database.
        settings: the app's settings.
        engine: the engine (its thread is shut down when the window closes).
        confirm: ``(question) -> bool`` for destructive actions (default: a message box).
    """

    reply_finished = Signal(object)   # the worker's finished dict, after it is saved
    stats_updated = Signal(object)    # every stats dict of the open conversation's reply (for panels)
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
        self._editing = False
        self._closed = False
        self._model_source = ""
        # Replies the database refused (disk full): shown, and saved again before the next write.
        self._unsaved: list[dict] = []
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
        self.setStatusBar(status := ChatStatusBar())
        self.status = status
        self._build_menus()
        self._connect()
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
        self._sent: tuple[int, int, str] | None = None   # the last message sent: (conv, id, text)
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
        self.chat.edit_requested.connect(self.edit_last)
        self.empty_download.clicked.connect(self.download_requested.emit)
        self.empty_open.clicked.connect(self.open_model_file)
        en = self.engine
        en.model_loaded.connect(self._on_model_loaded)
        en.load_failed.connect(self._on_load_failed)
        en.text_batch.connect(self._on_text)
        en.prefill_progress.connect(self._on_prefill)
        en.stats.connect(self._on_stats)
        en.error.connect(self.show_error)
        en.finished.connect(self._on_finished)

    def _restore(self) -> None:
        s = self.settings
        if not s.get("window/geometry").isEmpty():
            self.restoreGeometry(s.get("window/geometry"))
        if not s.get("window/state").isEmpty():
            self.restoreState(s.get("window/state"))
        if not s.get("window/splitter").isEmpty():
            self.splitter.restoreState(s.get("window/splitter"))
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
        return dock

    # ---- models ------------------------------------------------------------------------------
    def load_model(self, source: str = "") -> None:
        """Load a model on the worker (``""``: the default model); the window stays responsive.

        A reply being written is stopped first (and saved as stopped, like any other).
        """
        if self._reply is not None:
            self.engine.stop()
        self._model_source = source
        self.notice.hide()
        self.status.set_loading(source_label(source))
        self.chat.placeholder = "Loading the model…"
        self.stack.setCurrentIndex(0)
        self.engine.load(source, self.settings.get("model/device"))
        self._sync()

    def open_model_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a model file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def open_model_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a model folder (config.json + safetensors)")
        if path:
            self.load_model(path)

    def show_first_run(self) -> None:
        """The empty state: no model installed yet."""
        self.stack.setCurrentWidget(self.empty)
        self.status.set_model(None)
        self._sync()

    def _on_model_loaded(self, info: dict) -> None:
        self.status.set_model(info)
        self.chat.placeholder = ASK
        self.stack.setCurrentIndex(0)
        self.settings.set("model/source", self._model_source)
        if info.get("remote"):
            self.status.showMessage(f"Connected to {info['device'].removeprefix('server ')}", 5000)
        else:
            self.status.showMessage(f"Loaded {info['name']} in {info.get('load_seconds', 0):.1f} s", 5000)
        if info.get("notices"):  # a device fallback, a plain chat format (desktop.worker.EngineWorker.load_model)
            self.show_error(" ".join(info["notices"]))
        self._show_context_of(self._conv_id)
        self.model_changed.emit(info)
        self._sync()
        self.input.setFocus()

    def _on_load_failed(self, message: str) -> None:
        self.status.set_model(None)
        self.show_error(f"Could not load the model: {message}")
        if not self.engine.model:
            self.chat.placeholder = "No model is loaded. Use File > Open model, or download the default model."
            self.chat.viewport().update()
        self._sync()

    #: Said in the chat when the "stop" overflow policy finds the context full before a reply.
    CONTEXT_FULL = ('The context is full: <a href="new" style="color: white">start a new chat</a>, or '
                    '<a href="overflow" style="color: white">switch the overflow policy</a> to drop the oldest turns.')

    def _context_full(self, conv: int, message_id: int, text: str) -> None:
        """No reply fits: the message goes back to the box (not stored without a reply) and the
        banner offers the two ways on."""
        try:
            self.store.delete_last_message(conv, message_id)
        except (sqlite3.Error, OSError):
            log.warning("could not drop the message that got no reply", exc_info=True)
        if not self.input.toPlainText().strip():
            self.input.setPlainText(text)
        self.show_error(self.CONTEXT_FULL)
        self.status.showMessage("The context is full", 8000)

    def _on_notice_link(self, link: str) -> None:
        self.notice.hide()
        if link == "new":
            self.new_conversation()
        elif link == "overflow":
            self.settings.set("generation/overflow", "truncate-middle")
            self.status.showMessage("Overflow policy: truncate-middle (the oldest turns are dropped); "
                                    "send the message again", 8000)
        self.input.setFocus()

    def show_error(self, message: str) -> None:
        """One line for the user, in the window (never a traceback)."""
        self.notice.setText(message)
        self.notice.show()
        self.status.showMessage(message, 10000)

    # ---- conversations ---------------------------------------------------------------------
    @property
    def current_conversation(self) -> int:
        return self._conv_id

    @property
    def replying(self) -> bool:
        return self._reply is not None

    def new_conversation(self) -> int:
        if self._conv_id and not self.messages.rowCount() and self._reply is None:
            return self._conv_id   # the open chat is still empty: use it
        conv = self.store.create_conversation(model=self.engine.model["name"] if self.engine.model else "")
        self.conversations.add(conv)
        self.open_conversation(conv.id)
        self.input.setFocus()
        return conv.id

    def open_conversation(self, conv_id: int) -> None:
        if self._editing:
            self.cancel_edit()
        self._conv_id = conv_id
        self.settings.set("last_conversation", conv_id)
        self.sidebar.select(conv_id)
        self.messages.set_messages(self._rows_of(conv_id))
        r = self._reply
        if r is not None:
            r["row"] = -1
            if r["conv_id"] == conv_id:
                if r["kind"] == "regenerate":
                    last_user = self.messages.last_row("user")
                    self.messages.remove_from(last_user + 1)
                r["row"] = self.messages.append("assistant", r["text"], streaming=True)
        self.notice.hide()
        self._show_context_of(conv_id)
        self._update_title()
        self._sync()

    def _rows_of(self, conv_id: int) -> list[dict]:
        """The conversation's rows for the view: what is stored, then replies not saved yet."""
        rows = [vars(m) for m in self.store.messages(conv_id)] if conv_id else []
        for u in self._unsaved:
            if u["conv_id"] == conv_id:
                while u["kind"] == "regenerate" and rows and rows[-1]["role"] == "assistant":
                    rows.pop()
                rows.append({"role": "assistant", "content": u["text"], "finish_reason": u["reason"],
                             "stats": u["stats"]})
        return rows

    def _save_reply(self, u: dict):
        """Write one finished reply; None when its conversation is gone."""
        conv = u["conv_id"]
        if self.store.conversation(conv) is None:
            return None
        ids = {"token_ids": u.get("token_ids"), "token_model": u.get("token_model", "")}
        if u["kind"] == "regenerate":
            return self.store.replace_last_reply(conv, u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)
        return self.store.add_message(conv, "assistant", u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)

    def _save_unsaved(self) -> None:
        """Save the replies the database refused before, oldest first.

        Raises:
            sqlite3.Error, OSError: still refused (the rest stay queued, in order).
        """
        while self._unsaved:
            self._save_reply(self._unsaved[0])
            done = self._unsaved.pop(0)
            self.conversations.refresh(done["conv_id"])

    def _save_failed(self, error: Exception, what: str, kept: str = "it stays here and is saved with your next message") -> None:
        """One line: what could not be saved, why, where it is kept, and what to do."""
        log.warning("could not save %s", what, exc_info=True)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.show_error(f"Could not save {what} ({reason}); {kept}. Free some disk space.")

    def _update_title(self, *args) -> None:
        title = self.conversations.title(self._conv_id)
        self.setWindowTitle(f"{title} — attnchat" if title else "attnchat")

    def _show_context_of(self, conv_id: int) -> None:
        stats = {}
        for m in reversed(self.store.messages(conv_id) if conv_id else []):
            if m.role == "assistant" and m.stats:
                stats = m.stats
                break
        self.status.set_stats(stats)

    def delete_conversation(self, conv_id: int) -> None:
        title = self.conversations.title(conv_id)
        if not self.confirm(f"Delete the conversation “{title}”? This cannot be undone."):
            return
        if self._reply is not None and self._reply["conv_id"] == conv_id:
            self.engine.stop()
        try:
            self.store.delete(conv_id)
        except (sqlite3.Error, OSError) as e:
            log.warning("could not delete conversation %s", conv_id, exc_info=True)
            self.show_error(f"Could not delete the conversation ({e}); try again after freeing some disk space.")
            return
        self.engine.forget(conv_id)
        self._unsaved = [u for u in self._unsaved if u["conv_id"] != conv_id]
        self.conversations.remove(conv_id)
        if conv_id == self._conv_id:
            nxt = self.conversations.index(0).data(ConversationListModel.IdRole) if self.conversations.rowCount() else 0
            self.open_conversation(nxt)

    def export_conversation(self, conv_id: int, fmt: str, path: str | Path) -> None:
        """Write ``conv_id`` to ``path`` as ``"markdown"`` or ``"json"``."""
        if fmt == "json":
            text = json.dumps(self.store.export_json(conv_id), indent=2, ensure_ascii=False) + "\n"
        else:
            text = self.store.export_markdown(conv_id)
        Path(path).write_text(text, encoding="utf-8")

    def export_dialog(self, conv_id: int, fmt: str) -> None:
        if not conv_id:
            return
        ext, kind = (".json", "JSON (*.json)") if fmt == "json" else (".md", "Markdown (*.md)")
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in self.conversations.title(conv_id)).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export the conversation", name + ext, kind)
        if path:
            try:
                self.export_conversation(conv_id, fmt, path)
            except OSError as e:
                self.show_error(f"Could not export to {path}: {e.strerror or e}")
            else:
                self.status.showMessage(f"Exported to {path}", 5000)

    # ---- chatting ------------------------------------------------------------------------------
    def generation(self) -> dict:
        out = self.settings.generation_values()   # every generation/* setting (desktop.settings.values)
        out.update(self.generation_overrides)
        return out

    def _history(self, conv_id: int) -> list[tuple]:
        """``(role, content, token_ids, token_model)`` per stored message (the worker uses the ids
        when they belong to its model)."""
        return [(m.role, m.content, m.token_ids, m.token_model) for m in self.store.messages(conv_id)]

    def _can_start(self) -> bool:
        if self._reply is not None:
            self.status.showMessage("A reply is being written: wait for it, or press Stop", 4000)
            return False
        if not self.engine.model:
            self.status.showMessage("No model is loaded yet", 4000)
            return False
        return True

    def submit(self, text: str) -> None:
        """Send ``text`` (or, while editing, replace the last user message with it).

        A message the database refuses (disk full) is not sent: it stays in the input
        box, the error is shown, and sending again tries again.
        """
        if not text.strip() or not self._can_start():
            return
        try:
            self._save_unsaved()
            conv = self._conv_id or self.new_conversation()
            history = self._history(conv)
            if self._editing:
                msg = self.store.replace_last_user(conv, text)
            else:
                msg = self.store.add_message(conv, "user", text)
        except (sqlite3.Error, OSError) as e:
            self._save_failed(e, "your message", "it is still in the message box: send it again")
            return
        if self._editing:
            self._editing = False
            self.edit_banner.hide()
            self.messages.set_messages(self._rows_of(conv))
            request = self.engine.edit_last(conv, history, text, self.generation())
            kind = "edit"
        else:
            self.messages.append("user", text, id=msg.id)
            request = self.engine.send(conv, history, text, self.generation())
            kind = "send"
            self._sent = (conv, msg.id, text)
        if self.conversations.title(conv) == DEFAULT_TITLE:
            first = text.strip().splitlines()[0]
            try:
                self.store.rename(conv, first[:TITLE_CHARS] + ("…" if len(first) > TITLE_CHARS else ""))
            except (sqlite3.Error, OSError):  # a title is not worth stopping the message for
                log.warning("could not save the conversation's title", exc_info=True)
        self.conversations.refresh(conv)
        self.input.clear()
        self._begin(request, conv, kind)

    def regenerate(self) -> None:
        conv = self._conv_id
        if not conv or not self._can_start():
            return
        last_user = self.messages.last_row("user")
        if last_user < 0:
            return
        try:
            self._save_unsaved()   # the reply to replace must be in the database first
        except (sqlite3.Error, OSError) as e:
            self._save_failed(e, "the last reply")
            return
        history = self._history(conv)
        self.messages.remove_from(last_user + 1)
        self._begin(self.engine.regenerate(conv, history, self.generation()), conv, "regenerate")

    def edit_last(self) -> None:
        row = self.messages.last_row("user")
        if row < 0 or self._reply is not None:
            return
        self._editing = True
        self.input.setPlainText(self.messages.message(row)["content"])
        self.edit_banner.show()
        self.input.setFocus()
        self._sync()

    def cancel_edit(self) -> None:
        self._editing = False
        self.edit_banner.hide()
        self.input.clear()
        self._sync()

    def stop(self) -> None:
        if self._reply is not None:
            self.engine.stop()

    def _begin(self, request: int, conv: int, kind: str) -> None:
        self.notice.hide()
        row = self.messages.append("assistant", "", streaming=True)
        self._reply = {"request": request, "conv_id": conv, "kind": kind, "text": "", "row": row}
        self._sync()

    def _on_text(self, text: str) -> None:
        r = self._reply
        if r is None:
            return
        r["text"] += text
        if r["row"] >= 0:
            self.messages.append_text(r["row"], text)

    def _on_prefill(self, done: int, total: int) -> None:
        if self._reply is not None and self._reply["row"] >= 0:
            self.status.set_prefill(done, total)

    def _on_stats(self, stats: dict) -> None:
        if self._reply is not None and self._reply["row"] >= 0:
            self.status.set_stats(stats)
        self.stats_updated.emit(stats)

    def _on_finished(self, result: dict) -> None:
        r = self._reply
        if r is None or result["request"] != r["request"]:
            return
        self._reply = None
        conv, text, reason, stats = r["conv_id"], result["text"], result["reason"], result["stats"]
        sent, self._sent = getattr(self, "_sent", None), None
        if reason == "context" and not text and r["kind"] == "send" and sent and sent[0] == conv:
            self._context_full(conv, sent[1], sent[2])
        saved = unsaved = None
        if text and self.store.conversation(conv) is not None:
            entry = {"conv_id": conv, "kind": r["kind"], "text": text, "reason": reason, "stats": stats,
                     "token_ids": result.get("token_ids"), "token_model": result.get("token_model", "")}
            try:
                self._save_unsaved()
                saved = self._save_reply(entry)
                self.conversations.refresh(conv)
            except (sqlite3.Error, OSError) as e:   # disk full: keep it, save it with the next write
                self._unsaved.append(entry)
                unsaved = entry
                self._save_failed(e, "the reply")
        if r["row"] >= 0:
            if saved is not None:
                self.messages.finish(r["row"], id=saved.id, finish_reason=reason, stats=stats, content=text)
            elif unsaved is not None:
                self.messages.finish(r["row"], finish_reason=reason, stats=stats, content=text)
            else:   # nothing to keep (stopped before any text, or failed): show what is stored
                self.messages.set_messages(self._rows_of(conv))
            self.status.end_busy()
            if stats:
                self.status.set_stats(stats)
        self._sync()
        self.reply_finished.emit(result)

    def _sync(self) -> None:
        """Enable what can be done now."""
        busy = self._reply is not None
        ready = bool(self.engine.model) and not busy
        has_user = self.messages.last_row("user") >= 0
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
