"""The token count while typing: the message's tokens and the whole prompt's against the
context the reply would get, under the message box (as LM Studio and Open WebUI show it).

Counted on the engine thread (:meth:`desktop.worker.Engine.count`: the model's tokenizer and
chat template) 400 ms after the last keystroke, never while a reply is written (the engine is
busy then; the count follows the reply). Must not import torch or runtime.
"""
from __future__ import annotations

import sqlite3

from PySide6.QtCore import QObject, QTimer

from desktop.widgets.colors import error_text_color

__all__ = ["TokenCounter"]

#: Wait this long after a keystroke before counting (ms): a 30 KB paste is one count.
DELAY_MS = 400


class TokenCounter(QObject):
    """Counts the window's message box into ``window.page.token_count``."""

    def __init__(self, window):
        super().__init__(window)
        self.w = window
        self.label = window.page.token_count
        self._asked = 0
        self._timer = QTimer(self, singleShot=True, interval=DELAY_MS)
        self._timer.timeout.connect(self.count)
        window.input.textChanged.connect(self._timer.start)
        if hasattr(window, "attachments"):   # files in the message count too
            window.attachments.changed.connect(self._timer.start)
        window.reply_finished.connect(lambda *_: self._timer.start())
        window.model_changed.connect(lambda *_: self._timer.start())
        if hasattr(window.engine, "counted"):
            window.engine.counted.connect(self._counted)

    def count(self) -> None:
        """Ask the engine now (the timer calls this)."""
        w = self.w
        if w._closed:   # the window is gone (its database closed)
            return
        text = w.input.toPlainText().strip()
        if hasattr(w, "attachments"):
            text = w.attachments.message(text)
        if not text or not w.engine.model or w.replying or not hasattr(w.engine, "count"):
            self._asked = 0
            self.label.setText("")
            return
        conv = w.current_conversation
        try:
            history = [(m.role, m.content) for m in w.store.messages(conv)
                       if not w.replies.editing or m.id < w.replies.editing] if conv else []
        except sqlite3.Error:   # a count is not worth an error line
            return
        self._asked = w.engine.count(conv, history, text, w.generation())

    def _counted(self, d: dict) -> None:
        if d.get("request") != self._asked:
            return   # an older count, or the box changed since
        n, prompt, limit = int(d["message_tokens"]), int(d["prompt_tokens"]), int(d.get("context_limit") or 0)
        text = f"{n:,} token{'s' if n != 1 else ''} · prompt {prompt:,}"
        if limit:
            text += f" of {limit:,}"
        over = bool(limit) and prompt >= limit
        self.label.setText(text + (" · too long for the context" if over else ""))
        self.label.setStyleSheet(f"color: {error_text_color(self.w.palette())};" if over else "")
        self.label.setToolTip("This message's tokens, and the whole prompt's (the conversation, the system prompt "
                              "and the chat template) against the context the reply gets")
