"""The status bar: model, device, context used / limit, speed of the last reply, prefill progress.

Must not import torch or runtime; it reads the plain dicts the engine worker emits.
"""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

__all__ = ["ChatStatusBar", "PREFILL_BAR_MIN_TOKENS"]

#: Prompts shorter than this prefill in a blink: no progress bar for them (tokens).
PREFILL_BAR_MIN_TOKENS = 256


class ChatStatusBar(QStatusBar):
    """Permanent fields on the right; transient messages (errors, loading) on the left."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("statusBar")
        self.model_label = QLabel("No model")
        self.model_label.setObjectName("modelLabel")
        self.device_label = QLabel("")
        self.context_label = QLabel("")
        self.context_label.setToolTip("Tokens in the KV cache / the context limit")
        self.speed_label = QLabel("")
        self.speed_label.setToolTip("Time to first token and decode speed of the last reply")
        self.prefill = QProgressBar()
        self.prefill.setObjectName("prefillProgress")
        self.prefill.setMaximumWidth(180)
        self.prefill.setFormat("Reading prompt %p%")
        self.prefill.hide()
        self.addWidget(self.prefill)
        for w in (self.speed_label, self.context_label, self.device_label, self.model_label):
            w.setContentsMargins(8, 0, 8, 0)
            self.addPermanentWidget(w)
        self.context_limit = 0

    def set_loading(self, name: str) -> None:
        self.model_label.setText(f"Loading {name}…")
        self.device_label.setText("")
        self.prefill.setRange(0, 0)   # busy indicator: loading reports no fractions
        self.prefill.setFormat("Loading model")
        self.prefill.show()

    def set_model(self, info: dict | None) -> None:
        self.prefill.hide()
        self.prefill.setFormat("Reading prompt %p%")
        if not info:
            self.model_label.setText("No model")
            self.device_label.setText("")
            self.context_label.setText("")
            self.speed_label.setText("")
            return
        self.model_label.setText(info["name"])
        self.model_label.setToolTip(info.get("path", ""))
        self.device_label.setText(f"{info['device']} · {info.get('dtype', '')}".strip(" ·"))
        self.context_limit = int(info.get("context_limit", 0))
        self.set_context(0)
        self.speed_label.setText("")

    def set_context(self, used: int, limit: int | None = None) -> None:
        limit = limit or self.context_limit
        self.context_label.setText(f"Context {used:,} / {limit:,}" if limit else "")

    def set_stats(self, stats: dict | None) -> None:
        """Show a reply's figures (``TurnStats`` as a dict, plus ``context_used``)."""
        if not stats:
            self.set_context(0)
            self.speed_label.setText("")
            return
        self.set_context(int(stats.get("context_used", 0)), int(stats.get("context_limit", 0)) or None)
        parts = []
        if stats.get("ttft_s"):
            parts.append(f"TTFT {stats['ttft_s']:.2f} s")
        if stats.get("decode_tokens_per_s"):
            parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
        self.speed_label.setText(" · ".join(parts))

    def set_prefill(self, done: int, total: int) -> None:
        if total < PREFILL_BAR_MIN_TOKENS or done >= total:
            self.prefill.hide()
            return
        self.prefill.setRange(0, total)
        self.prefill.setValue(done)
        self.prefill.show()

    def end_busy(self) -> None:
        self.prefill.hide()
