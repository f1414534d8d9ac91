"""Files in the next message: Attach…, drops on the message box, a chip per file with its
tokens, and the message they make (:mod:`desktop.chat.attachments` reads them).

The window owns one :class:`Attachments`. A file's tokens are counted on the engine thread
(:meth:`desktop.worker.Engine.count`, the model's tokenizer) as it is attached, and the token
count under the box counts the whole message, files included, against the context before it
is sent. The files go when the message is sent; a message refused as too long for the context
gets them back with its text. Must not import torch or runtime.
"""
from __future__ import annotations

import html
import logging

from PySide6.QtCore import QEvent, QObject, Signal
from PySide6.QtWidgets import QFileDialog, QToolButton

from desktop.chat.attachments import Attachment, AttachmentError, message_text, read_attachment
from desktop.file_dialogs import documents_dir
from desktop.flow_layout import FlowLayout
from desktop.sizes import size_text


__all__ = ["Attachments", "FILE_KINDS"]

log = logging.getLogger(__name__)

#: The open dialog's filter.
FILE_KINDS = ("Text, code, Markdown and PDF (*.txt *.md *.markdown *.rst *.pdf *.py *.js *.ts *.c *.h *.cpp *.rs "
              "*.go *.java *.json *.yaml *.yml *.toml *.html *.css *.sh *.sql *.csv *.log);;All files (*)")


class Attachments(QObject):
    """The files attached to the next message of ``window`` (its ``page.attachments_bar``,
    ``page.attach_button`` and ``input``)."""

    #: The files changed (the token count counts them).
    changed = Signal()

    def __init__(self, window):
        super().__init__(window)
        self.w = window
        self.files: list[Attachment] = []
        self._tokens: dict[int, int] = {}   # id(file) -> its tokens (counted on the engine thread)
        self._asked: dict[int, Attachment] = {}   # count request -> file
        self.bar = window.page.attachments_bar
        self.flow = FlowLayout(self.bar, spacing=4)
        self.flow.setContentsMargins(0, 0, 0, 0)
        window.page.attach_button.clicked.connect(self.choose)
        window.input.setAcceptDrops(True)
        window.input.viewport().installEventFilter(self)
        window.input.installEventFilter(self)
        if hasattr(window.engine, "counted"):
            window.engine.counted.connect(self._counted)
        window.model_changed.connect(lambda *_: self._recount())

    # ---- adding ------------------------------------------------------------------------
    def choose(self) -> None:
        """Attach…: an open dialog for one or more files."""
        paths, _ = QFileDialog.getOpenFileNames(self.w, "Attach files to the message", documents_dir(), FILE_KINDS)
        self.add_paths(paths)
        self.w.input.setFocus()   # the message goes on in the box (the focus went back to the search field)

    def add_paths(self, paths) -> list[str]:
        """Read and attach ``paths``; returns the refusals (each said in the window, one line)."""
        refused = []
        for path in paths:
            try:
                f = read_attachment(path)
            except AttachmentError as e:
                refused.append(str(e))
                continue
            self.files.append(f)
            self._count(f)
        if refused:
            self.w.show_error("Not attached: " + "; ".join(refused) + ".")
        self._show()
        return refused

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt API
        kind = event.type()
        if kind in (QEvent.Type.DragEnter, QEvent.Type.DragMove) and event.mimeData().hasUrls():
            event.acceptProposedAction()
            return True
        if kind == QEvent.Type.Drop and event.mimeData().hasUrls():
            paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
            event.acceptProposedAction()
            self.add_paths(paths)
            return True
        return False

    # ---- the message ---------------------------------------------------------------------
    def message(self, typed: str) -> str:
        """The message the typed text and the files make (:func:`message_text`)."""
        return message_text(typed, self.files)

    def take(self) -> list[Attachment]:
        """The files, gone from the box (the message was sent with them)."""
        files, self.files = self.files, []
        self._show()
        return files

    def restore(self, files: list[Attachment]) -> None:
        """Put ``files`` back (their message was refused), before any attached since."""
        self.files = list(files) + [f for f in self.files if f not in files]
        self._show()

    def remove(self, f: Attachment) -> None:
        self.files = [x for x in self.files if x is not f]
        self._show()

    # ---- counting and showing ------------------------------------------------------------
    def _count(self, f: Attachment) -> None:
        en = self.w.engine
        if en.model and hasattr(en, "count"):
            self._asked[en.count(0, [], f.block(), self.w.generation())] = f

    def _recount(self) -> None:
        self._tokens.clear()
        for f in self.files:
            self._count(f)
        self._show()

    def _counted(self, d: dict) -> None:
        f = self._asked.pop(d.get("request"), None)
        if f is not None:
            self._tokens[id(f)] = int(d["message_tokens"])
            self._show(emit=False)

    def tokens(self, f: Attachment) -> int | None:
        return self._tokens.get(id(f))

    def _show(self, emit: bool = True) -> None:
        while self.flow.count():
            item = self.flow.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        for f in self.files:
            chip = QToolButton()
            chip.setObjectName("attachmentChip")
            chip.setText(f"{f.name} · {_size(f)}" + (f" · {self.tokens(f):,} tokens" if self.tokens(f) else "") + "  ✕")
            chip.setToolTip(f"{html.escape(f.path)}<br>Click to take it out of the message.")
            chip.clicked.connect(lambda _=False, f=f: self.remove(f))
            self.flow.add(chip)
        self.bar.setVisible(bool(self.files))
        if self.files:
            # Place the chips now: a bar hidden and shown again at the size it had does not lay its
            # layout out again, and the new chips stayed 640 x 480 at its corner (a grey strip, no
            # names) after a draft came back with its conversation.
            self.flow.invalidate()
            self.bar.updateGeometry()
            self.flow.setGeometry(self.bar.contentsRect())
        self.w.input.allow_empty = bool(self.files)
        if emit:
            self.changed.emit()


def _size(f: Attachment) -> str:
    what = f"{f.pages:,} page{'s' if f.pages != 1 else ''}" if f.pages else ""
    n = f.size_bytes
    size = size_text(n)
    return f"{what}, {size}" if what else size
