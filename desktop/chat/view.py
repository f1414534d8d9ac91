"""The chat view and the message box.

:class:`ChatView` lists the messages (:class:`desktop.chat.messages.MessageListModel`),
painted by :class:`desktop.chat.delegate.MessageDelegate`, and turns clicks on a
message's buttons into actions: copies to the clipboard here, and signals for what the
window does (edit, regenerate, stop). Must not import torch or runtime.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QModelIndex, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QPainter, QPalette
from PySide6.QtWidgets import QAbstractItemView, QListView, QMenu, QPlainTextEdit, QStyleOptionViewItem

from desktop.chat.delegate import MARKDOWN_LIMIT, Button, Header, MessageDelegate
from desktop.chat.messages import MessageListModel, describe_finish, reply_seed

__all__ = ["MessageListModel", "MessageDelegate", "ChatView", "MessageInput", "describe_finish", "MARKDOWN_LIMIT"]

#: How long a button says "Copied ✓" after a click (ms).
FLASH_MS = 1500


class ChatView(QListView):
    """The message list: follows the bottom while a reply streams, unless scrolled up.

    A click on a message's button (:class:`desktop.chat.delegate.Button`) copies the
    message or the code block (the button then says "Copied ✓" for :data:`FLASH_MS`), or
    emits :attr:`edit_requested` (the row), :attr:`regenerate_requested`, :attr:`branch_requested`
    or :attr:`stop_requested`. ``busy`` (set by the window while a reply is written) hides
    Edit and Regenerate; ``edit_row`` (>= 0 while a message is being edited) marks that
    message and fades the ones after it, which sending the edit drops; ``unseen`` fades the
    first messages, which the model no longer sees.
    """

    copied = Signal(str)             # what was copied: "message" or "code"
    regenerate_requested = Signal()
    edit_requested = Signal(int)     # the user message's row
    stop_requested = Signal()
    branch_requested = Signal(int, int)   # a reply's row, -1 or +1: show its previous or next branch
    seed_requested = Signal(int)          # write the next replies with this reply's seed

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
        self.setMouseTracking(True)   # the pointing hand over buttons
        self._placeholder = ""
        self._busy = False
        self._edit_row = -1
        self._unseen = 0
        self._unseen_stale = False
        #: Which overflow policy hid the :attr:`unseen` messages: "rolling" (evicted from the KV
        #: cache) or "truncate-middle" (left out of the prompt): their notes say which.
        self.unseen_policy = "rolling"
        self.flash: tuple[int, str, int] | None = None   # (row, button name, arg) that says "Copied ✓"
        self._flash_timer = QTimer(self, singleShot=True, interval=FLASH_MS)
        self._flash_timer.timeout.connect(self._end_flash)
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

    @property
    def busy(self) -> bool:
        """A reply is being written (Edit and Regenerate are hidden)."""
        return self._busy

    @busy.setter
    def busy(self, on: bool) -> None:
        if bool(on) != self._busy:
            self._busy = bool(on)
            self._relayout()

    @property
    def unseen(self) -> int:
        """How many messages, from the first, the model no longer sees (rolling overflow evicted
        them from its KV cache): shown faded, with a note."""
        return self._unseen

    @unseen.setter
    def unseen(self, n: int) -> None:
        if int(n) != self._unseen:
            self._unseen = int(n)
            self._relayout()   # their header notes change

    @property
    def unseen_stale(self) -> bool:
        """True when :attr:`unseen` is the last reply's view and no cache of the conversation
        exists now (a restart, other cache settings): their notes say so."""
        return self._unseen_stale

    @unseen_stale.setter
    def unseen_stale(self, on: bool) -> None:
        if bool(on) != self._unseen_stale:
            self._unseen_stale = bool(on)
            self._relayout()

    @property
    def edit_row(self) -> int:
        """The row of the message being edited, or -1."""
        return self._edit_row

    @edit_row.setter
    def edit_row(self, row: int) -> None:
        if row != self._edit_row:
            self._edit_row = row
            if row >= 0 and self.model() is not None:
                self.scrollTo(self.model().index(row, 0), QAbstractItemView.ScrollHint.PositionAtTop)
            self.viewport().update()

    def setModel(self, model) -> None:  # noqa: N802 - Qt API
        super().setModel(model)
        model.dataChanged.connect(self._row_changed)
        model.modelReset.connect(self._follow)
        model.rowsInserted.connect(self._follow)

    def _row_changed(self, top: QModelIndex, bottom: QModelIndex, roles=()) -> None:
        # A row's height changes as it streams: ask the view to lay out again (cheap: cached docs).
        self.itemDelegate().sizeHintChanged.emit(top)

    def _relayout(self) -> None:
        self.scheduleDelayedItemsLayout()
        self.viewport().update()

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

    # ---- buttons -----------------------------------------------------------------------------
    def _option(self, index: QModelIndex) -> QStyleOptionViewItem:
        option = QStyleOptionViewItem()
        self.initViewItemOption(option)
        option.rect = self.visualRect(index)
        return option

    def buttons(self, row: int) -> list[Button]:
        """The buttons of message ``row`` as painted now (viewport coordinates)."""
        index = self.model().index(row, 0)
        return self.delegate().buttons(self._option(index), index) if index.isValid() else []

    def header(self, row: int) -> Header:
        """Message ``row``'s header as painted now (viewport coordinates)."""
        index = self.model().index(row, 0)
        return self.delegate().header(self._option(index), index)

    def button_at(self, pos: QPoint) -> tuple[int, Button] | None:
        """(row, button) under ``pos`` in the viewport, or None."""
        index = self.indexAt(pos)
        if not index.isValid():
            return None
        b = self.delegate().hit(self._option(index), index, pos)
        return (index.row(), b) if b is not None else None

    def press(self, row: int, button: Button) -> None:
        """Do what ``button`` of message ``row`` does (a click on it)."""
        if button.name == "copy":
            self.copy_row(row)
        elif button.name == "code":
            self.copy_code(row, button.arg)
        elif button.name == "edit":
            self.edit_requested.emit(row)
        elif button.name == "regenerate":
            self.regenerate_requested.emit()
        elif button.name == "stop":
            self.stop_requested.emit()
        elif button.name in ("prev", "next"):
            self.branch_requested.emit(row, -1 if button.name == "prev" else 1)

    def copy_row(self, row: int) -> None:
        """Put message ``row``'s text (its Markdown source) on the clipboard."""
        if 0 <= row < self.model().rowCount():
            QGuiApplication.clipboard().setText(self.model().index(row).data(MessageListModel.ContentRole))
            self._start_flash(row, "copy", -1)
            self.copied.emit("message")

    def copy_code(self, row: int, k: int) -> None:
        """Put code block ``k`` of message ``row`` on the clipboard, as written (tabs kept)."""
        index = self.model().index(row, 0)
        option = self._option(index)
        code = self.delegate().content(option, index).code
        if 0 <= k < len(code):
            QGuiApplication.clipboard().setText(code[k].text)
            self._start_flash(row, "code", k)
            self.copied.emit("code")

    def _start_flash(self, row: int, name: str, arg: int) -> None:
        self.flash = (row, name, arg)
        self._flash_timer.start()
        self.viewport().update()

    def _end_flash(self) -> None:
        self.flash = None
        self.viewport().update()

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802
        if event.button() == Qt.MouseButton.LeftButton:
            hit = self.button_at(event.position().toPoint())
            if hit is not None:
                self.press(*hit)
                event.accept()
                return
        super().mouseReleaseEvent(event)

    def mouseMoveEvent(self, event) -> None:  # noqa: N802
        over = self.button_at(event.position().toPoint()) is not None
        self.viewport().setCursor(Qt.CursorShape.PointingHandCursor if over else Qt.CursorShape.ArrowCursor)
        super().mouseMoveEvent(event)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.matches(QKeySequence.StandardKey.Copy) and self.selected_row() >= 0:
            self.copy_row(self.selected_row())
            return
        super().keyPressEvent(event)

    def contextMenuEvent(self, event) -> None:  # noqa: N802
        index = self.indexAt(event.pos())
        if not index.isValid():
            return
        menu = QMenu(self)
        menu.addAction("Copy message", lambda: self.copy_row(index.row()))
        option = self._option(index)
        for k, _ in enumerate(self.delegate().content(option, index).code):
            menu.addAction(f"Copy code block {k + 1}", lambda k=k: self.copy_code(index.row(), k))
        names = self.delegate().names(index)
        if "edit" in names:
            menu.addAction("Edit and resend", lambda: self.edit_requested.emit(index.row()))
        if "regenerate" in names:
            menu.addAction("Regenerate", self.regenerate_requested.emit)
        seed = reply_seed(index.data(MessageListModel.StatsRole))
        if seed is not None:
            menu.addAction(f"Use seed {seed} for the next replies", lambda: self.seed_requested.emit(seed))
        if "branch" in names:
            menu.addAction("Previous version of this reply", lambda: self.branch_requested.emit(index.row(), -1))
            menu.addAction("Next version of this reply", lambda: self.branch_requested.emit(index.row(), 1))
        if "stop" in names:
            menu.addAction("Stop", self.stop_requested.emit)
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

    #: Whether a message with no typed text may be sent (files are attached to it).
    allow_empty = False

    def submit(self) -> None:
        """Emit :attr:`submitted` with the text, unless it is empty or only whitespace (and no
        file goes with it: :attr:`allow_empty`)."""
        text = self.toPlainText()
        if text.strip() or self.allow_empty:
            self.submitted.emit(text.strip())

    def _fit(self, *args) -> None:
        lines = max(1, min(self.MAX_LINES, int(self.document().documentLayout().documentSize().height())))
        m = self.contentsMargins()
        h = lines * self.fontMetrics().lineSpacing() + int(2 * self.document().documentMargin()) + m.top() + m.bottom() + 2
        self.setFixedHeight(h)
