"""How one message is painted: who wrote it, its one-click actions, its Markdown.

The header of every bubble carries its actions as small buttons: Copy (every message),
Edit (a user message), Regenerate (the last reply), ``‹ 2/3 ›`` (a regenerated reply's
branches: the earlier replies are kept); the reply being written shows instead
a coloured state ("Reading the prompt… 40%", then "Writing…") and a Stop button. Each code
block has a "Copy code" button at its top right (the block's first line wraps before it).
In a narrow column the header's note moves under the name rather than over it
(:class:`Header`). :meth:`MessageDelegate.hit` maps a point to the button under it, with the
geometry :meth:`MessageDelegate.paint` used.

Laid-out documents (:func:`desktop.chat.markdown.build_document`) are kept in a small
cache, so repainting and relayout cost a dictionary lookup for unchanged rows.
Must not import torch or runtime.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from PySide6.QtCore import QModelIndex, QPoint, QRect, QRectF, QSize, Qt
from PySide6.QtGui import QAbstractTextDocumentLayout, QFont, QFontMetrics, QPainter, QPalette
from PySide6.QtWidgets import QListView, QStyle, QStyledItemDelegate, QStyleOptionViewItem

from desktop.chat.markdown import Rendered, build_document, code_tint, mix
from desktop.chat.messages import MessageListModel, describe_finish, duration

__all__ = ["Button", "DROPPED_NOTE", "Header", "MessageDelegate", "MARKDOWN_LIMIT", "UNSEEN_NOTE"]

#: Past this many characters a message is shown as plain text: Markdown layout of a
#: huge paste costs more than it is worth (and a paste is rarely Markdown).
MARKDOWN_LIMIT = 16_000

#: Button name -> label. "code" buttons carry the code block's number.
LABELS = {"copy": "Copy", "edit": "Edit", "regenerate": "Regenerate", "stop": "■ Stop", "code": "Copy code",
          "prev": "‹", "next": "›", "branch": ""}
#: Buttons as wide as their own label (the others keep room for "Copied ✓"); "branch" says "2/3".
NARROW = ("prev", "next", "branch")
COPIED = "Copied ✓"
#: The header's note on a message the model no longer sees (rolling overflow evicted it).
UNSEEN_NOTE = "evicted: the model no longer sees this"
#: The same note when no cache of the conversation exists now (a restart, other cache settings):
#: it says what the last reply saw; the next message reads the conversation again.
STALE_UNSEEN_NOTE = "evicted: the last reply did not see this"
#: The notes when truncate-middle left the message out of the prompt (not a cache eviction).
DROPPED_NOTE = "left out: the model no longer sees this"
STALE_DROPPED_NOTE = "left out: the last reply did not see this"


@dataclass(frozen=True)
class Button:
    """A painted button: ``name`` (a :data:`LABELS` key), ``arg`` (a code block's number,
    else -1) and its rectangle in viewport coordinates."""

    name: str
    rect: QRect
    arg: int = -1


@dataclass(frozen=True)
class Header:
    """A bubble's header as painted (viewport coordinates): who wrote it (``name``, elided
    to fit), the note (:meth:`MessageDelegate.state_text`, "" when none) and the header's
    buttons. The note sits between the name and the buttons when it fits there whole, else
    on a second line under them (``lines`` == 2), elided only if even that line is too
    narrow: no two of these rectangles ever intersect."""

    name: str
    name_rect: QRect
    note: str
    note_rect: QRect
    buttons: list[Button]
    lines: int


class MessageDelegate(QStyledItemDelegate):
    """Paints a message (see the module docstring). Reads from its view (a
    :class:`desktop.chat.view.ChatView`): ``busy``, ``edit_row``, ``unseen`` and ``flash``."""

    PAD = 10       # inside a bubble (px)
    MARGIN = 6     # around a bubble (px)
    CACHE = 256    # laid-out documents kept
    GAP = 6        # between buttons (px)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._docs: OrderedDict[tuple, Rendered] = OrderedDict()

    def clear_cache(self) -> None:
        self._docs.clear()

    def rendered(self, text: str, width: int, font: QFont, palette: QPalette) -> Rendered:
        """``text``'s laid-out document and code blocks (cached)."""
        key = (text, width, font.key(), palette.cacheKey())
        got = self._docs.get(key)
        if got is not None:
            self._docs.move_to_end(key)
            return got
        reserve = self._code_button_width(QFontMetrics(font)) + self.GAP
        got = build_document(text, font, palette, width, plain=len(text) > MARKDOWN_LIMIT, code_reserve=reserve)
        self._docs[key] = got
        while len(self._docs) > self.CACHE:
            self._docs.popitem(last=False)
        return got

    def _document(self, text, width, font, palette):
        return self.rendered(text, width, font, palette).doc

    # ---- geometry --------------------------------------------------------------------------
    def _view(self):
        view = self.parent()
        return view if isinstance(view, QListView) else None

    def _row_width(self, option: QStyleOptionViewItem) -> int:
        # QListView sometimes asks for a size hint with an empty rect: rows span the viewport.
        view = self._view()
        return view.viewport().width() if view is not None else option.rect.width()

    def _text_width(self, option: QStyleOptionViewItem) -> int:
        return self._row_width(option) - 2 * (self.MARGIN + self.PAD)

    def _line_height(self, option: QStyleOptionViewItem) -> int:
        return option.fontMetrics.height() + 6

    def _bubble(self, option: QStyleOptionViewItem) -> QRect:
        return option.rect.adjusted(self.MARGIN, self.MARGIN, -self.MARGIN, -self.MARGIN)

    def _header_line(self, option: QStyleOptionViewItem) -> QRect:
        """The header's first line: the name, the note when it fits, the buttons."""
        b = self._bubble(option)
        return QRect(b.left() + self.PAD, b.top() + self.PAD // 2 + 1, b.width() - 2 * self.PAD,
                     self._line_height(option))

    def header(self, option: QStyleOptionViewItem, index: QModelIndex) -> Header:
        """Where the header's parts go (see :class:`Header`)."""
        line = self._header_line(option)
        fm = option.fontMetrics
        bold = QFont(option.font)
        bold.setBold(True)
        bold_fm = QFontMetrics(bold)
        buttons: list[Button] = []
        right = line.right()
        for name in reversed(self.names(index)):
            label = self.label(name, index)
            w = fm.horizontalAdvance(label) + 12 if name in NARROW else \
                max(fm.horizontalAdvance(label), fm.horizontalAdvance(COPIED)) + 14
            buttons.insert(0, Button(name, QRect(right - w + 1, line.top(), w, line.height())))
            right -= w + self.GAP
        end = (buttons[0].rect.left() - self.GAP) if buttons else line.right() + 1   # first x past the text
        who = "You" if index.data(MessageListModel.RoleRole) == "user" else "Assistant"
        name = bold_fm.elidedText(who, Qt.TextElideMode.ElideRight, max(0, end - line.left()))
        name_rect = QRect(line.left(), line.top(), bold_fm.horizontalAdvance(name), line.height())
        streaming = bool(index.data(MessageListModel.StreamingRole))
        note = self.state_text(index)
        if not note:
            return Header(name, name_rect, "", QRect(), buttons, 1)
        note = ("● " if streaming else "") + note
        note_fm = bold_fm if streaming else fm
        w = note_fm.horizontalAdvance(note)
        if name_rect.right() + 1 + self.GAP + w <= end:   # fits between the name and the buttons
            return Header(name, name_rect, note, QRect(end - w, line.top(), w, line.height()), buttons, 1)
        note = note_fm.elidedText(note, Qt.TextElideMode.ElideRight, line.width())
        rect = QRect(line.left(), line.bottom() + 1, note_fm.horizontalAdvance(note), line.height())
        return Header(name, name_rect, note, rect, buttons, 2)

    def _header_height(self, option: QStyleOptionViewItem, index: QModelIndex) -> int:
        return self.header(option, index).lines * self._line_height(option)

    def _origin(self, option: QStyleOptionViewItem, index: QModelIndex) -> QPoint:
        line = self._header_line(option)
        return QPoint(self._bubble(option).left() + self.PAD, line.top() + self._header_height(option, index) + 2)

    def content(self, option, index) -> Rendered:
        return self.rendered(index.data(MessageListModel.ContentRole) or " ", self._text_width(option),
                             option.font, option.palette)

    def names(self, index: QModelIndex) -> list[str]:
        """The header's buttons for this message, left to right."""
        view = self._view()
        busy = bool(getattr(view, "busy", False))
        if index.data(MessageListModel.StreamingRole):
            return ["stop"]
        if index.data(MessageListModel.RoleRole) == "user":
            return ["copy"] + ([] if busy else ["edit"])
        last = index.row() == index.model().rowCount() - 1
        branches = ["prev", "branch", "next"] if (index.data(MessageListModel.VersionsRole) or 0) > 1 else []
        return branches + ["copy"] + (["regenerate"] if last and not busy and index.row() > 0 else [])

    @staticmethod
    def label(name: str, index: QModelIndex) -> str:
        """What button ``name`` of the message at ``index`` says."""
        if name == "branch":
            return f"{index.data(MessageListModel.VersionRole) or 1}/{index.data(MessageListModel.VersionsRole) or 1}"
        return LABELS[name]

    def buttons(self, option: QStyleOptionViewItem, index: QModelIndex) -> list[Button]:
        """Every button of the message at ``option.rect``: the header's, then "Copy code" per code block."""
        fm = option.fontMetrics
        out = list(self.header(option, index).buttons)
        rendered = self.content(option, index)
        if rendered.code:
            layout = rendered.doc.documentLayout()
            origin = self._origin(option, index)
            w = self._code_button_width(fm)
            for k, block in enumerate(rendered.code):
                top = layout.blockBoundingRect(rendered.doc.findBlockByNumber(block.first)).top()
                x = origin.x() + int(rendered.doc.textWidth()) - w
                out.append(Button("code", QRect(x, origin.y() + int(top) + 1, w, fm.height() + 2), k))
        return out

    @staticmethod
    def _code_button_width(fm: QFontMetrics) -> int:
        return max(fm.horizontalAdvance(LABELS["code"]), fm.horizontalAdvance(COPIED)) + 12

    def hit(self, option: QStyleOptionViewItem, index: QModelIndex, pos: QPoint) -> Button | None:
        """The button under ``pos`` (viewport coordinates), or None."""
        for b in self.buttons(option, index):
            if b.rect.contains(pos) and b.name != "branch" and self.enabled(b.name, index):
                return b
        return None

    @staticmethod
    def enabled(name: str, index: QModelIndex) -> bool:
        """False for the branch arrow that has no branch to go to (‹ on the first, › on the last)."""
        version = index.data(MessageListModel.VersionRole) or 1
        versions = index.data(MessageListModel.VersionsRole) or 1
        return not ((name == "prev" and version <= 1) or (name == "next" and version >= versions))

    def state_text(self, index: QModelIndex) -> str:
        """The header's note: the reply being written's state, else why it ended and its speed."""
        if index.data(MessageListModel.StreamingRole):
            progress = index.data(MessageListModel.ProgressRole)
            if progress and not index.data(MessageListModel.ContentRole):
                done, total, left = (tuple(progress) + (None,))[:3]
                about = f" · about {duration(left)} left" if left is not None else ""
                return f"Reading the prompt… {100 * done // max(1, total)}%{about}"
            return "Writing…"
        if index.row() < getattr(self._view(), "unseen", 0):
            stale = getattr(self._view(), "unseen_stale", False)
            if getattr(self._view(), "unseen_policy", "rolling") == "truncate-middle":
                return STALE_DROPPED_NOTE if stale else DROPPED_NOTE
            return STALE_UNSEEN_NOTE if stale else UNSEEN_NOTE
        return describe_finish(index.data(MessageListModel.FinishRole), index.data(MessageListModel.StatsRole))

    # ---- painting --------------------------------------------------------------------------
    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        doc = self.content(option, index).doc
        h = self._header_height(option, index) + 4 + int(doc.size().height()) + 2 * self.PAD + 2 * self.MARGIN
        return QSize(self._row_width(option), h)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        painter.save()
        pal = option.palette
        view = self._view()
        edit_row = getattr(view, "edit_row", -1)
        if 0 <= edit_row < index.row() or index.row() < getattr(view, "unseen", 0):
            painter.setOpacity(0.4)   # dropped when the edited message is sent; or out of the model's window
        role = index.data(MessageListModel.RoleRole)
        streaming = bool(index.data(MessageListModel.StreamingRole))
        bubble = self._bubble(option)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        base, text_c, accent = (pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text),
                                pal.color(QPalette.ColorRole.Highlight))
        painter.setBrush(mix(base, accent, 0.12) if role == "user" else base)
        marked = bool(option.state & QStyle.StateFlag.State_Selected) or streaming or index.row() == edit_row
        pen = painter.pen()
        pen.setColor(accent if marked else mix(base, text_c, 0.15))
        pen.setWidth(2 if streaming or index.row() == edit_row else 1)
        painter.setPen(pen)
        painter.drawRoundedRect(bubble, 8, 8)

        head = self.header(option, index)
        bold = QFont(option.font)
        bold.setBold(True)
        painter.setFont(bold)
        painter.setPen(text_c)
        painter.drawText(head.name_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, head.name)
        buttons = self.buttons(option, index)
        flash = getattr(view, "flash", None)
        for b in buttons:
            if b.name == "branch":   # not a button: which branch is shown
                painter.setFont(option.font)
                painter.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
                painter.drawText(b.rect, Qt.AlignmentFlag.AlignCenter, self.label(b.name, index))
            elif b.name != "code":
                copied = flash == (index.row(), b.name, b.arg)
                self._paint_button(painter, option, b, COPIED if copied else self.label(b.name, index),
                                   filled=b.name == "stop", enabled=self.enabled(b.name, index))
        if head.note:
            painter.setFont(bold if streaming else option.font)
            painter.setPen(accent if streaming else pal.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(head.note_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, head.note)

        doc = self.content(option, index).doc
        origin = self._origin(option, index)
        painter.translate(origin)
        ctx = QAbstractTextDocumentLayout.PaintContext()
        ctx.palette = pal
        # Draw only what is visible: a long message is mostly off screen.
        visible = option.rect.intersected(view.viewport().rect()) if view is not None else option.rect
        ctx.clip = QRectF(visible.translated(-origin))
        doc.documentLayout().draw(painter, ctx)
        painter.translate(-origin)
        rendered = self.content(option, index)
        for b in buttons:   # over the code, which was drawn after the header
            if b.name == "code":
                # The code's tint behind the button (the first line keeps that place free).
                first = rendered.doc.findBlockByNumber(rendered.code[b.arg].first)
                r = rendered.doc.documentLayout().blockBoundingRect(first).translated(origin.x(), origin.y())
                painter.fillRect(QRectF(b.rect.left() - self.GAP, r.top(), origin.x() + rendered.doc.textWidth()
                                        - b.rect.left() + self.GAP, r.height()), code_tint(pal))
                copied = flash == (index.row(), b.name, b.arg)
                self._paint_button(painter, option, b, COPIED if copied else LABELS[b.name], filled=False)
        painter.restore()

    def _paint_button(self, painter: QPainter, option, b: Button, label: str, *, filled: bool,
                      enabled: bool = True) -> None:
        pal = option.palette
        accent = pal.color(QPalette.ColorRole.Highlight)
        base = pal.color(QPalette.ColorRole.Base)
        r = b.rect.adjusted(0, 2, 0, -2) if b.name != "code" else b.rect
        painter.setBrush(accent if filled else mix(base, pal.color(QPalette.ColorRole.Text), 0.06))
        painter.setPen(accent if filled else mix(base, pal.color(QPalette.ColorRole.Text), 0.25))
        painter.drawRoundedRect(r, 5, 5)
        painter.setFont(option.font)
        painter.setPen(pal.color(QPalette.ColorRole.HighlightedText) if filled else pal.color(
            QPalette.ColorRole.Text if enabled else QPalette.ColorRole.PlaceholderText))
        painter.drawText(r, Qt.AlignmentFlag.AlignCenter, label)
