"""The chat: a message list model, a delegate that renders Markdown, the view, the input box.

Each message is one row of :class:`MessageListModel`; a streaming reply grows by
:meth:`MessageListModel.append_text`, which emits ``dataChanged`` for that one row.
:class:`MessageDelegate` renders a row's Markdown with ``QTextDocument.setMarkdown``
(paragraphs, lists, code blocks, tables) and keeps the laid-out documents in a small
cache, so repainting and relayout cost a dictionary lookup for unchanged rows.
Must not import torch or runtime.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel, QEvent, QModelIndex, QPoint, QRect, QRectF, QSize, Qt, QTimer, Signal,
)
from PySide6.QtGui import (
    QAbstractTextDocumentLayout, QColor, QFont, QFontDatabase, QGuiApplication, QKeySequence,
    QPainter, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument, QTextFormat,
)
from PySide6.QtWidgets import (
    QAbstractItemView, QListView, QMenu, QPlainTextEdit, QStyle, QStyledItemDelegate,
    QStyleOptionViewItem,
)

__all__ = ["MessageListModel", "MessageDelegate", "ChatView", "MessageInput", "describe_finish"]

#: Past this many characters a message is shown as plain text: Markdown layout of a
#: huge paste costs more than it is worth (and a paste is rarely Markdown).
MARKDOWN_LIMIT = 16_000


def describe_finish(reason: str | None, stats: dict | None) -> str:
    """A reply's footnote: why it ended (when not naturally) and its speed."""
    notes = {"cancelled": "stopped", "length": "length limit", "context": "context full", "error": "failed"}
    parts = [notes[reason]] if reason in notes else []
    if stats and stats.get("completion_tokens"):
        parts.append(f"{stats['completion_tokens']} tokens")
        if stats.get("decode_tokens_per_s"):
            parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    return " · ".join(parts)


class MessageListModel(QAbstractListModel):
    """The messages of the open conversation.

    Each row is a dict: ``id`` (database id or None), ``role``, ``content``,
    ``streaming`` (bool), ``finish_reason``, ``stats`` (dict).
    """

    IdRole = Qt.ItemDataRole.UserRole + 1
    RoleRole = Qt.ItemDataRole.UserRole + 2
    ContentRole = Qt.ItemDataRole.UserRole + 3
    StreamingRole = Qt.ItemDataRole.UserRole + 4
    FinishRole = Qt.ItemDataRole.UserRole + 5
    StatsRole = Qt.ItemDataRole.UserRole + 6

    _KEYS = {IdRole: "id", RoleRole: "role", ContentRole: "content", StreamingRole: "streaming",
             FinishRole: "finish_reason", StatsRole: "stats"}

    def __init__(self, parent=None):
        super().__init__(parent)
        self._rows: list[dict[str, Any]] = []

    # ---- Qt model API --------------------------------------------------------------------
    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row = self._rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return row["content"]
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"{'You' if row['role'] == 'user' else 'Assistant'}: {row['content']}"
        key = self._KEYS.get(role)
        return row.get(key) if key else None

    def roleNames(self) -> dict[int, bytes]:
        names = {r: k.encode() for r, k in self._KEYS.items()}
        names[Qt.ItemDataRole.DisplayRole] = b"display"
        return names

    def flags(self, index: QModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    # ---- edits ---------------------------------------------------------------------------
    def set_messages(self, messages: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self._rows = [self._row(m) for m in messages]
        self.endResetModel()

    def append(self, role: str, content: str = "", *, id: int | None = None, streaming: bool = False,
               finish_reason: str | None = None, stats: dict | None = None) -> int:
        n = len(self._rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self._rows.append(self._row(dict(id=id, role=role, content=content, streaming=streaming,
                                         finish_reason=finish_reason, stats=stats or {})))
        self.endInsertRows()
        return n

    def append_text(self, row: int, text: str) -> None:
        """Streaming: add ``text`` to ``row``'s content (one ``dataChanged`` for that row)."""
        self._rows[row]["content"] += text
        idx = self.index(row)
        self.dataChanged.emit(idx, idx, [Qt.ItemDataRole.DisplayRole, self.ContentRole])

    def finish(self, row: int, *, id: int | None = None, finish_reason: str | None = None,
               stats: dict | None = None, content: str | None = None) -> None:
        r = self._rows[row]
        r.update(streaming=False, finish_reason=finish_reason, stats=dict(stats or {}))
        if id is not None:
            r["id"] = id
        if content is not None:
            r["content"] = content
        idx = self.index(row)
        self.dataChanged.emit(idx, idx)

    def remove_from(self, row: int) -> None:
        """Remove ``row`` and every row after it."""
        n = len(self._rows)
        if 0 <= row < n:
            self.beginRemoveRows(QModelIndex(), row, n - 1)
            del self._rows[row:]
            self.endRemoveRows()

    def last_row(self, role: str) -> int:
        """The last row with ``role``, or -1."""
        for i in range(len(self._rows) - 1, -1, -1):
            if self._rows[i]["role"] == role:
                return i
        return -1

    def message(self, row: int) -> dict[str, Any]:
        return dict(self._rows[row])

    @staticmethod
    def _row(m: dict[str, Any]) -> dict[str, Any]:
        return {"id": m.get("id"), "role": m["role"], "content": m.get("content", ""),
                "streaming": bool(m.get("streaming", False)), "finish_reason": m.get("finish_reason"),
                "stats": dict(m.get("stats") or {})}


class MessageDelegate(QStyledItemDelegate):
    """Paints a message: who wrote it, its Markdown, and a footnote for replies."""

    PAD = 10       # inside a bubble (px)
    MARGIN = 6     # around a bubble (px)
    CACHE = 256    # laid-out documents kept

    def __init__(self, parent=None):
        super().__init__(parent)
        self._docs: OrderedDict[tuple, QTextDocument] = OrderedDict()

    def clear_cache(self) -> None:
        self._docs.clear()

    def _document(self, text: str, width: int, font: QFont, palette: QPalette) -> QTextDocument:
        key = (text, width, font.key(), palette.cacheKey())
        doc = self._docs.get(key)
        if doc is not None:
            self._docs.move_to_end(key)
            return doc
        doc = QTextDocument()
        doc.setDefaultFont(font)
        doc.setDocumentMargin(0)
        if len(text) > MARKDOWN_LIMIT:
            doc.setPlainText(text)
        else:
            doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
            _style_code(doc, palette)
        doc.setTextWidth(max(40, width))
        self._docs[key] = doc
        while len(self._docs) > self.CACHE:
            self._docs.popitem(last=False)
        return doc

    def _row_width(self, option: QStyleOptionViewItem) -> int:
        # QListView sometimes asks for a size hint with an empty rect: rows span the viewport.
        view = self.parent()
        return view.viewport().width() if isinstance(view, QListView) else option.rect.width()

    def _text_width(self, option: QStyleOptionViewItem) -> int:
        return self._row_width(option) - 2 * (self.MARGIN + self.PAD)

    def _header_height(self, option: QStyleOptionViewItem) -> int:
        return option.fontMetrics.height() + 4

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        width = self._text_width(option)
        doc = self._document(index.data(MessageListModel.ContentRole) or " ", width, option.font, option.palette)
        h = self._header_height(option) + int(doc.size().height()) + 2 * self.PAD + 2 * self.MARGIN
        return QSize(self._row_width(option), h)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        painter.save()
        pal = option.palette
        role = index.data(MessageListModel.RoleRole)
        bubble = option.rect.adjusted(self.MARGIN, self.MARGIN, -self.MARGIN, -self.MARGIN)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if role == "user":
            fill = _mix(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Highlight), 0.12)
        else:
            fill = pal.color(QPalette.ColorRole.Base)
        painter.setBrush(fill)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        border = pal.color(QPalette.ColorRole.Highlight) if selected else _mix(
            pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.15)
        painter.setPen(border)
        painter.drawRoundedRect(bubble, 8, 8)

        # Header: who, and for replies a footnote (stopped, tokens, speed).
        head = QRect(bubble.left() + self.PAD, bubble.top() + self.PAD // 2 + 2,
                     bubble.width() - 2 * self.PAD, self._header_height(option))
        bold = QFont(option.font)
        bold.setBold(True)
        painter.setFont(bold)
        painter.setPen(pal.color(QPalette.ColorRole.Text))
        painter.drawText(head, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         "You" if role == "user" else "Assistant")
        note = "writing…" if index.data(MessageListModel.StreamingRole) else describe_finish(
            index.data(MessageListModel.FinishRole), index.data(MessageListModel.StatsRole))
        if note:
            painter.setFont(option.font)
            painter.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(head, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, note)

        doc = self._document(index.data(MessageListModel.ContentRole) or " ", self._text_width(option),
                             option.font, pal)
        origin = QPoint(bubble.left() + self.PAD, head.bottom() + 2)
        painter.translate(origin)
        ctx = QAbstractTextDocumentLayout.PaintContext()
        ctx.palette = pal
        # Draw only what is visible: a long message is mostly off screen.
        view = self.parent()
        visible = option.rect.intersected(view.viewport().rect()) if isinstance(view, QListView) else option.rect
        ctx.clip = QRectF(visible.translated(-origin))
        doc.documentLayout().draw(painter, ctx)
        painter.restore()


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


def _style_code(doc: QTextDocument, palette: QPalette) -> None:
    """Code blocks: a monospace font on a tinted background (setMarkdown gives neither a background)."""
    fixed = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    tint = _mix(palette.color(QPalette.ColorRole.Base), palette.color(QPalette.ColorRole.Text), 0.08)
    block = doc.begin()
    while block.isValid():
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.hasProperty(QTextFormat.Property.BlockCodeLanguage):
            cur = QTextCursor(block)
            bf = QTextBlockFormat()
            bf.setBackground(tint)
            bf.setLeftMargin(6)
            cur.mergeBlockFormat(bf)
            cur.select(QTextCursor.SelectionType.BlockUnderCursor)
            cf = QTextCharFormat()
            cf.setFontFamilies(fixed.families())
            cur.mergeCharFormat(cf)
        block = block.next()


class ChatView(QListView):
    """The message list: follows the bottom while a reply streams, unless scrolled up."""

    copy_requested = Signal(int)
    regenerate_requested = Signal()
    edit_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setItemDelegate(MessageDelegate(self))
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setUniformItemSizes(False)
        self.setFrameShape(QListView.Shape.NoFrame)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.DefaultContextMenu)
        self._placeholder = ""
        self._stick = True
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(lambda v: setattr(self, "_stick", v >= bar.maximum() - 4))
        bar.rangeChanged.connect(lambda lo, hi: bar.setValue(hi) if self._stick else None)

    @property
    def placeholder(self) -> str:
        """The text shown in an empty chat ("Loading the model…", "Ask anything…")."""
        return self._placeholder

    @placeholder.setter
    def placeholder(self, text: str) -> None:
        if text != self._placeholder:
            self._placeholder = text
            self.viewport().update()   # nothing else repaints an empty chat when only this changes

    def setModel(self, model) -> None:  # noqa: N802 - Qt API
        super().setModel(model)
        model.dataChanged.connect(self._row_changed)
        model.modelReset.connect(self._follow)
        model.rowsInserted.connect(self._follow)

    def _row_changed(self, top: QModelIndex, bottom: QModelIndex, roles=()) -> None:
        # A row's height changes as it streams: ask the view to lay out again (cheap: cached docs).
        self.itemDelegate().sizeHintChanged.emit(top)

    def _follow(self, *args) -> None:
        # Deferred: scrolling now would force the whole layout inside the model change.
        self._stick = True
        QTimer.singleShot(0, self.scrollToBottom)

    def delegate(self) -> MessageDelegate:
        return self.itemDelegate()  # type: ignore[return-value]

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self.delegate().clear_cache()
            self.scheduleDelayedItemsLayout()
        super().changeEvent(event)

    def selected_row(self) -> int:
        rows = self.selectionModel().selectedRows() if self.selectionModel() else []
        return rows[0].row() if rows else -1

    def copy_row(self, row: int) -> None:
        if 0 <= row < self.model().rowCount():
            QGuiApplication.clipboard().setText(self.model().index(row).data(MessageListModel.ContentRole))

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.matches(QKeySequence.StandardKey.Copy) and self.selected_row() >= 0:
            self.copy_row(self.selected_row())
            return
        super().keyPressEvent(event)

    def contextMenuEvent(self, event) -> None:  # noqa: N802
        index = self.indexAt(event.pos())
        if not index.isValid():
            return
        model = self.model()
        menu = QMenu(self)
        menu.addAction("Copy message", lambda: self.copy_row(index.row()))
        role = index.data(MessageListModel.RoleRole)
        if role == "user" and index.row() == model.last_row("user"):
            menu.addAction("Edit and resend", self.edit_requested.emit)
        if role == "assistant" and index.row() == model.rowCount() - 1:
            menu.addAction("Regenerate", self.regenerate_requested.emit)
        menu.exec(event.globalPos())

    def paintEvent(self, event) -> None:  # noqa: N802
        super().paintEvent(event)
        if self.placeholder and (self.model() is None or self.model().rowCount() == 0):
            p = QPainter(self.viewport())
            p.setPen(self.palette().color(QPalette.ColorRole.PlaceholderText))
            p.drawText(self.viewport().rect().adjusted(24, 24, -24, -24),
                       Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap, self.placeholder)


class MessageInput(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter adds a line; grows up to about 8 lines."""

    submitted = Signal(str)
    cancelled = Signal()

    MAX_LINES = 8

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("messageInput")
        self.setPlaceholderText("Message the model (Shift+Enter: new line)")
        self.setTabChangesFocus(True)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.cancelled.emit()
            return
        super().keyPressEvent(event)

    def submit(self) -> None:
        """Emit :attr:`submitted` with the text, unless it is empty or only whitespace."""
        text = self.toPlainText()
        if text.strip():
            self.submitted.emit(text.strip())

    def _fit(self, *args) -> None:
        lines = max(1, min(self.MAX_LINES, int(self.document().documentLayout().documentSize().height())))
        m = self.contentsMargins()
        h = lines * self.fontMetrics().lineSpacing() + int(2 * self.document().documentMargin()) + m.top() + m.bottom() + 2
        self.setFixedHeight(h)
