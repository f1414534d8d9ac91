"""The status bar: model, device, context used / limit, speed of the last reply, prefill progress.

Must not import torch or runtime; it reads the plain dicts the engine worker emits.
"""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QProgressBar, QSizeGrip, QStatusBar, QWidget

from desktop.chat.messages import duration

__all__ = ["ChatStatusBar", "PREFILL_BAR_MIN_TOKENS", "StatusField"]

#: Qt's QWIDGETSIZE_MAX: no maximum width.
QWIDGETSIZE_MAX = (1 << 24) - 1
#: Prompts shorter than this prefill in a blink: no progress bar for them (tokens).
PREFILL_BAR_MIN_TOKENS = 256


#: The narrowest a permanent field gets when the fields do not fit beside each other (pixels).
FIELD_MIN_WIDTH = 120


class StatusField(QLabel):
    """A permanent field of the status bar that gives way: narrower than its text it shows the
    text's start and "…" (the whole text in its tooltip), so the fields' widths never add up to
    a minimum width that makes the window wider (beside the serve toggle's "Serving at …"
    label, which keeps its address whole, they grew it by 111 px)."""

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt API
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), FIELD_MIN_WIDTH), hint.height())

    def setText(self, text: str) -> None:  # noqa: N802 - Qt API
        super().setText(text)
        self._sync_tip()

    def setToolTip(self, tip: str) -> None:  # noqa: N802 - Qt API
        self._tip = tip
        self._sync_tip()

    def _sync_tip(self) -> None:
        tip, text = getattr(self, "_tip", ""), self.text()
        cut = self.width() < self.sizeHint().width() and text and text not in tip
        super().setToolTip((f"{text}\n{tip}" if tip else text) if cut else tip)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._sync_tip()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt API
        rect = self.contentsRect()
        if self.width() >= self.sizeHint().width() or self.textFormat() == Qt.TextFormat.RichText:
            super().paintEvent(event)
            return
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        painter = QPainter(self)
        self.style().drawItemText(painter, rect, int(self.alignment()), self.palette(), self.isEnabled(), text,
                                  self.foregroundRole())


class ChatStatusBar(QStatusBar):
    """Permanent fields on the right; transient messages (errors, loading) on the left."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("statusBar")
        self.model_label = StatusField("No model")
        self.model_label.setObjectName("modelLabel")
        self.device_label = StatusField("")
        self.context_label = StatusField("")
        self.context_label.setToolTip("Tokens in the KV cache / the context limit")
        self.speed_label = StatusField("")
        self.speed_label.setToolTip("Time to first token and decode speed of the last reply")
        self._permanent: list[QWidget] = []
        self.prefill = QProgressBar()
        self.prefill.setObjectName("prefillProgress")
        self.prefill.setMaximumWidth(320)   # "Reading prompt 40% · about 1 min 05 s left"
        self.prefill.setFormat("Reading prompt %p%")
        self.prefill.hide()
        self.addWidget(self.prefill)
        for w in (self.speed_label, self.context_label, self.device_label, self.model_label):
            w.setContentsMargins(8, 0, 8, 0)
            self.addPermanentWidget(w)
        #: The limit a new reply gets (the window's ``context_limit()``); a reply's stats say their own.
        self.context_limit = 0
        self.messageChanged.connect(self._message_changed)
        self._hidden_for_message: list[QWidget] = []
        self._used, self._reply_limit, self._has_model = 0, 0, False

    def set_loading(self, name: str) -> None:
        self.model_label.setText(f"Loading {name}…")
        self.device_label.setText("")
        self.prefill.setRange(0, 0)   # busy indicator: loading reports no fractions
        self.prefill.setFormat("Loading model")
        self.prefill.show()

    def set_model(self, info: dict | None, context_limit: int | None = None) -> None:
        """The loaded model (None: none); ``context_limit``: the limit a reply gets (default the model's maximum)."""
        self.prefill.hide()
        self.prefill.setFormat("Reading prompt %p%")
        self._has_model = bool(info)
        if not info:
            self.model_label.setText("No model")
            self.device_label.setText("")
            self.context_label.setText("")
            self.speed_label.setText("")
            return
        self.model_label.setText(info["name"])
        self.model_label.setToolTip(info.get("path", ""))
        self.device_label.setText(f"{info['device']} · {info.get('dtype', '')}".strip(" ·"))
        self.context_limit = int(context_limit if context_limit is not None else info.get("context_limit", 0))
        self.set_context(0)
        self.speed_label.setText("")

    def set_context(self, used: int, limit: int | None = None) -> None:
        """``used`` tokens of ``limit`` (a reply's own limit; None: :attr:`context_limit`)."""
        self._used, self._reply_limit = used, limit or 0
        limit = limit or self.context_limit
        self.context_label.setText(f"Context {used:,} / {limit:,}" if limit else "")
        self.context_label.setToolTip("Tokens in the KV cache / the context limit")

    def set_default_limit(self, limit: int) -> None:
        """A new limit from the settings: shown unless a reply's own limit is shown."""
        self.context_limit = limit
        if not self._reply_limit and self._has_model:
            self.set_context(self._used)

    def set_stats(self, stats: dict | None) -> None:
        """Show a reply's figures (``TurnStats`` as a dict, plus ``context_used``). With
        ``"stale": True`` (no cache of the conversation exists now: an earlier run, or other
        cache settings) the context shows 0 of the limit the next reply gets, and the figures
        are marked as the last reply's."""
        if not stats:
            self.set_context(0)
            self.speed_label.setText("")
            return
        stale = bool(stats.get("stale"))
        if stale:
            self.set_context(0)
            used, limit = int(stats.get("context_used", 0)), int(stats.get("context_limit", 0))
            self.context_label.setText(self.context_label.text() + f" (last reply {used:,})")
            self.context_label.setToolTip(
                "No KV cache for this conversation yet: your next message reads it again. "
                f"{self.context_limit:,} is the limit the next reply gets with the current settings; the last "
                f"reply's cache held {used:,} tokens" + (f" of {limit:,}" if limit else "") + ".")
        else:
            self.set_context(int(stats.get("context_used", 0)), int(stats.get("context_limit", 0)) or None)
        parts = []
        if stats.get("ttft_s"):
            parts.append(f"TTFT {stats['ttft_s']:.2f} s")
        if stats.get("decode_tokens_per_s"):
            parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
        threads, most = int(stats.get("decode_threads") or 0), int(stats.get("max_threads") or 0)
        tip = "Time to first token and decode speed of the last reply"
        if 0 < threads < most:
            parts.append(f"{threads} of {most} threads")
            tip += (f"\nDecoding on {threads} of {most} CPU threads: measured faster right now, most likely "
                    "because another program keeps a core busy. The app tries all of them again now and then.")
        self.speed_label.setText(("Last reply: " if stale and parts else "") + " · ".join(parts))
        self.speed_label.setToolTip(tip)

    def set_prefill(self, done: int, total: int, left: float | None = None) -> None:
        """``done`` of ``total`` prompt tokens read; ``left``: the seconds still to go (None: not known yet)."""
        if total < PREFILL_BAR_MIN_TOKENS or done >= total:
            self.prefill.hide()
            return
        self.prefill.setRange(0, total)
        self.prefill.setValue(done)
        self.prefill.setFormat("Reading prompt %p%" + (f" · about {duration(left)} left" if left is not None else ""))
        self.prefill.show()

    def end_busy(self) -> None:
        self.prefill.hide()

    # ---- messages -----------------------------------------------------------------------------
    def addPermanentWidget(self, widget: QWidget, stretch: int = 0) -> None:  # noqa: N802 - Qt API
        self._permanent.append(widget)
        super().addPermanentWidget(widget, stretch)

    def insertPermanentWidget(self, index: int, widget: QWidget, stretch: int = 0) -> int:  # noqa: N802 - Qt API
        self._permanent.append(widget)   # e.g. the serve toggle's "Serving at …" label
        return super().insertPermanentWidget(index, widget, stretch)

    def fields(self) -> list[QWidget]:
        """The permanent widgets on the right (ours and any added later)."""
        return list(self._permanent)

    def message_room(self) -> int:
        """Pixels Qt draws a message in now: from x 6 to the first permanent widget still shown
        (less 2), or to the size grip (QStatusBarPrivate::messageRect), after a layout pass."""
        self.layout().activate()
        right = self.width() - 12
        grip = next((g for g in self.findChildren(QSizeGrip) if g.parent() is self and g.isVisible()), None)
        if grip is not None:
            right = min(right, grip.x())
        shown = [w.x() - 2 for w in self.fields() if w.isVisible()]
        return max(min([right, *shown]) - 6, 0)

    def showMessage(self, text: str, timeout: int = 0) -> None:  # noqa: N802 - Qt API
        """Show ``text`` whole: a message longer than the room beside the permanent labels
        folds them away while it is shown ("Connected to 127.0.0.1:37" was cut there); one longer
        than the whole bar is cut at its end with "…" and given whole in the tooltip (the
        window shows errors whole in its notice above the message box too)."""
        self._restore_fields()
        fm = self.fontMetrics()
        if text and fm.horizontalAdvance(text) > self.message_room():
            # Folded to no width rather than hidden: their owners show and hide them (the serve
            # label), and that must still hold when the message goes.
            self._hidden_for_message = [w for w in self.fields() if not w.isHidden()]
            for w in self._hidden_for_message:
                w.setMaximumWidth(0)
        shown = fm.elidedText(text, Qt.TextElideMode.ElideRight, self.message_room()) if text else text
        self.setToolTip(text if shown != text else "")
        super().showMessage(shown, timeout)

    def _message_changed(self, text: str) -> None:
        if not text:
            self._restore_fields()
            self.setToolTip("")

    def _restore_fields(self) -> None:
        for w in self._hidden_for_message:
            w.setMaximumWidth(QWIDGETSIZE_MAX)
        self._hidden_for_message = []

