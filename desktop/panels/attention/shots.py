"""``attnchat --screenshot``: the attention panel in its four views, with the real model.

Called by :mod:`desktop.screenshots` once a conversation exists. Opens the panel (as a
floating window of a fixed size, so the pictures do not depend on the other docks),
measures every head and chooses the best induction head, sends one more message and
saves, for each palette ``<p>``: ``panel-attention-heads-<p>.png``,
``panel-attention-live-<p>.png`` (mid-reply), ``panel-attention-snapshot-<p>.png`` and
``panel-attention-formula-<p>.png``, the Insight tab's views
(:mod:`desktop.panels.attention.insight.shots`), and ``main-attention-<p>.png`` (the panel
docked in the window).
The panel is closed again afterwards. Must not import torch or runtime.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from PySide6.QtWidgets import QApplication

from desktop.panels.attention.insight.shots import shoot_insight
from desktop.panels.attention.panel import ATLAS, LIVE, NUMBERS, PANEL_NAME, SNAPSHOT

__all__ = ["shoot", "PROMPT"]

PROMPT = "Repeat the function once more, exactly."
SIZE = (560, 860)


def _until(app: QApplication, settle: Callable, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the attention panel showed no {what} within {timeout_s:.0f} s")
        settle(app, 50)


def shoot(app: QApplication, window, out: Path, written: list[Path], *, themes, settle: Callable,
          save: Callable, themed: Callable, wait: Callable, timeout_s: float = 600) -> None:
    """Save the attention panel's pictures (see the module docstring) into ``out``."""
    dock = window.panels[PANEL_NAME]
    panel = dock.widget()
    dock.setFloating(True)
    dock.resize(*SIZE)
    dock.show()
    settle(app)
    others = [d for n, d in window.panels.items() if n != PANEL_NAME and d.isVisible()]

    def show(view: int, ready: Callable[[], bool], name: str) -> None:
        panel.tabs.setCurrentIndex(view)
        _until(app, settle, lambda: ready() and not panel.busy(view), timeout_s, name)
        for theme in themes:
            themed(app, theme)
            save(dock, out / f"panel-attention-{name}-{theme}.png", written)

    try:
        # The atlas first: its best induction head is the one the other views show.
        panel.tabs.setCurrentIndex(ATLAS)
        _until(app, settle, lambda: panel.atlas.scores is not None and not panel.busy(ATLAS), timeout_s, "head scores")
        layer, head, _ = panel.atlas.top_heads("induction", 1)[0]
        panel.select(layer, head)
        show(ATLAS, lambda: True, "heads")
        panel.tabs.setCurrentIndex(LIVE)
        settle(app)
        window.submit(PROMPT)
        _until(app, settle, lambda: panel.live.frame is not None and (
            not window.replying or len(window.replies.reply["text"]) >= 60), timeout_s, "live attention")
        for theme in themes:
            themed(app, theme)
            save(dock, out / f"panel-attention-live-{theme}.png", written)
        if window.replying:
            wait(window.reply_finished, timeout_s)
        settle(app)
        panel.snapshot.hide_first.setChecked(True)
        show(SNAPSHOT, lambda: panel.snapshot.snap is not None and panel.snapshot.snap["head"] == head
             and panel.snapshot.heat.ready(), "snapshot")
        show(NUMBERS, lambda: panel.numbers.steps is not None, "formula")
        shoot_insight(app, panel, dock, out, written, themes=themes, settle=settle, save=save, themed=themed,
                      timeout_s=timeout_s)
        panel.tabs.setCurrentIndex(SNAPSHOT)
        dock.setFloating(False)
        for other in others:   # the panel in its place, the other docks out of the way
            other.hide()
        window.resize(1280, 800)
        for theme in themes:
            themed(app, theme)
            save(window, out / f"main-attention-{theme}.png", written)
    finally:
        dock.setFloating(False)
        dock.hide()
        for other in others:
            other.show()
        window.resize(1100, 720)
        settle(app)
