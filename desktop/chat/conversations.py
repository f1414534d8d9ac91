"""The conversation list: a list model over the store, a search (titles and messages), and the side panel.

Renaming edits the title in place (F2, double-click or the context menu) and writes it
through to the store. Must not import torch or runtime.
"""
from __future__ import annotations

import sqlite3
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView, QHBoxLayout, QLineEdit, QListView, QMenu, QPushButton, QVBoxLayout, QWidget,
)

from desktop.chat.store import Conversation, Store

__all__ = ["ConversationListModel", "ConversationFilter", "ConversationPanel"]


class ConversationListModel(QAbstractListModel):
    """Conversations, most recently updated first; the display and edit role is the title."""

    IdRole = Qt.ItemDataRole.UserRole + 1
    TitleRole = Qt.ItemDataRole.UserRole + 2
    UpdatedRole = Qt.ItemDataRole.UserRole + 3

    def __init__(self, store: Store, parent=None):
        super().__init__(parent)
        self._store = store
        self._rows: list[Conversation] = []
        self.reload()

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        c = self._rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole, self.TitleRole):
            return c.title
        if role == Qt.ItemDataRole.ToolTipRole:
            return c.title
        if role == self.IdRole:
            return c.id
        if role == self.UpdatedRole:
            return c.updated_at
        return None

    def setData(self, index: QModelIndex, value: Any, role: int = Qt.ItemDataRole.EditRole) -> bool:  # noqa: N802
        if not index.isValid() or role != Qt.ItemDataRole.EditRole:
            return False
        title = " ".join(str(value).split())
        if not title:
            return False
        c = self._rows[index.row()]
        if title != c.title:
            self._store.rename(c.id, title)
            self._rows[index.row()] = Conversation(c.id, title, c.created_at, c.updated_at, c.model)
            self.dataChanged.emit(index, index)
        return True

    def flags(self, index: QModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return (Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEditable
                | Qt.ItemFlag.ItemNeverHasChildren)

    def roleNames(self) -> dict[int, bytes]:
        return {Qt.ItemDataRole.DisplayRole: b"display", self.IdRole: b"id", self.TitleRole: b"title",
                self.UpdatedRole: b"updated"}

    # ---- edits ---------------------------------------------------------------------------
    def reload(self) -> None:
        self.beginResetModel()
        self._rows = self._store.conversations()
        self.endResetModel()

    def row_of(self, conv_id: int) -> int:
        for i, c in enumerate(self._rows):
            if c.id == conv_id:
                return i
        return -1

    def add(self, conv: Conversation) -> None:
        self.beginInsertRows(QModelIndex(), 0, 0)
        self._rows.insert(0, conv)
        self.endInsertRows()

    def remove(self, conv_id: int) -> None:
        row = self.row_of(conv_id)
        if row >= 0:
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._rows[row]
            self.endRemoveRows()

    def refresh(self, conv_id: int) -> None:
        """Re-read one conversation (its title or time changed) and move it to the top."""
        row = self.row_of(conv_id)
        conv = self._store.conversation(conv_id)
        if row < 0 or conv is None:
            return
        self._rows[row] = conv
        idx = self.index(row)
        self.dataChanged.emit(idx, idx)
        if row > 0:
            self.beginMoveRows(QModelIndex(), row, row, QModelIndex(), 0)
            self._rows.insert(0, self._rows.pop(row))
            self.endMoveRows()

    @property
    def store(self) -> Store:
        return self._store

    def title(self, conv_id: int) -> str:
        row = self.row_of(conv_id)
        return self._rows[row].title if row >= 0 else ""


class ConversationFilter(QSortFilterProxyModel):
    """Shows the conversations whose title contains the search text (any case), or whose
    messages contain its words (:meth:`Store.search`, full-text); a match in the messages
    is the row's tooltip."""

    def __init__(self, store: Store | None = None, parent=None):
        super().__init__(parent)
        self._store = store
        self.matches: dict[int, str] = {}   # conversation id -> a snippet of the match
        self.setFilterRole(ConversationListModel.TitleRole)
        self.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)

    def search(self, text: str) -> None:
        """Show the conversations that ``text`` finds (all for ``""``)."""
        try:
            self.matches = self._store.search(text) if self._store is not None and text.strip() else {}
        except sqlite3.Error:   # a locked or broken file: the titles still filter
            self.matches = {}
        self.setFilterFixedString(text.strip())

    def filterAcceptsRow(self, row: int, parent: QModelIndex) -> bool:  # noqa: N802 - Qt API
        conv = self.sourceModel().index(row, 0, parent).data(ConversationListModel.IdRole)
        return conv in self.matches or super().filterAcceptsRow(row, parent)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.ToolTipRole and self.filterRegularExpression().pattern():
            snippet = self.matches.get(index.data(ConversationListModel.IdRole))
            if snippet:
                return f"{index.data(ConversationListModel.TitleRole)}\n…{snippet}…"
        return super().data(index, role)


class ConversationPanel(QWidget):
    """The left side: a filter box, a New chat button and the list."""

    selected = Signal(int)            # conversation id
    new_requested = Signal()
    delete_requested = Signal(int)
    export_requested = Signal(int, str)   # conversation id, "markdown" | "json"

    def __init__(self, model: ConversationListModel, parent=None):
        super().__init__(parent)
        self.setObjectName("conversationPanel")
        self.model = model
        self.proxy = ConversationFilter(model.store, self)
        self.proxy.setSourceModel(model)

        self.filter = QLineEdit(placeholderText="Search chats")
        self.filter.setToolTip("Finds the chats whose title or messages contain these words")
        self.filter.setClearButtonEnabled(True)
        self.filter.textChanged.connect(self._search)
        #: The conversation the window shows (what :meth:`select` or a click made current).
        self.open_id = 0
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)

        self.list = QListView()
        self.list.setObjectName("conversationList")
        self.list.setModel(self.proxy)
        self.list.setUniformItemSizes(True)
        # Long titles end in "…" (the tooltip has the whole title) instead of a scrollbar.
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed
                                  | QAbstractItemView.EditTrigger.DoubleClicked)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.selectionModel().currentChanged.connect(self._current_changed)
        self.list.installEventFilter(self)

        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.filter, 1)
        top.addWidget(self.new_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 0, 6)
        lay.addLayout(top)
        lay.addWidget(self.list, 1)

    def current_id(self) -> int:
        idx = self.list.currentIndex()
        return idx.data(ConversationListModel.IdRole) if idx.isValid() else 0

    def _search(self, text: str) -> None:
        """Filter the list; the open conversation stays open. When the filter hid the current
        row, Qt moved the current index to a neighbour and that opened another conversation
        at each keystroke."""
        self.list.selectionModel().blockSignals(True)
        try:
            self.proxy.search(text)
            self._show_current(self.open_id)
        finally:
            self.list.selectionModel().blockSignals(False)
        self.list.viewport().update()

    def _show_current(self, conv_id: int) -> None:
        """Highlight ``conv_id`` if it is listed, else nothing (signals are the caller's)."""
        row = self.model.row_of(conv_id)
        idx = self.proxy.mapFromSource(self.model.index(row)) if row >= 0 else QModelIndex()
        if idx.isValid():
            self.list.setCurrentIndex(idx)
        else:
            self.list.selectionModel().clear()

    def select(self, conv_id: int) -> None:
        """Make ``conv_id`` current (clearing the filter if it hides it), without re-emitting."""
        self.open_id = conv_id
        row = self.model.row_of(conv_id)
        if row < 0:
            self.list.clearSelection()
            return
        proxy_idx = self.proxy.mapFromSource(self.model.index(row))
        if not proxy_idx.isValid():
            self.filter.clear()
            proxy_idx = self.proxy.mapFromSource(self.model.index(row))
        self.list.blockSignals(True)
        self.list.selectionModel().blockSignals(True)
        self.list.setCurrentIndex(proxy_idx)
        self.list.selectionModel().blockSignals(False)
        self.list.blockSignals(False)
        self.list.viewport().update()

    def rename(self, conv_id: int) -> None:
        self.select(conv_id)
        self.list.edit(self.list.currentIndex())

    def _current_changed(self, current: QModelIndex, previous: QModelIndex) -> None:
        if current.isValid():
            self.open_id = current.data(ConversationListModel.IdRole)
            self.selected.emit(self.open_id)

    def _menu(self, pos) -> None:
        idx = self.list.indexAt(pos)
        if not idx.isValid():
            return
        conv_id = idx.data(ConversationListModel.IdRole)
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.list.edit(idx))
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(conv_id, "markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(conv_id, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(conv_id))
        menu.exec(self.list.viewport().mapToGlobal(pos))

    def eventFilter(self, obj, event) -> bool:  # noqa: N802
        if obj is self.list and event.type() == event.Type.KeyPress and event.matches(QKeySequence.StandardKey.Delete):
            if self.current_id():
                self.delete_requested.emit(self.current_id())
                return True
        return super().eventFilter(obj, event)
