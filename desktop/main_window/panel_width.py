"""Docked panels never take the chat below half the window.

A dock as wide as its widest row of controls would leave the chat a strip the divider cannot
widen, and the saved window state would bring it back at every start. So each panel's
content wraps (:mod:`desktop.flow_layout`), and :class:`PanelWidthGuard`
gives every side dock area a maximum width: what the chat can spare above half the
window. The divider then moves freely inside that bound; the width the user gave a panel
(remembered with the window, :meth:`PanelWidthGuard.widths`) is clamped to it, and given
back when the window widens again (a window restored on a smaller screen too). Below
:data:`PANEL_FLOOR` px the bound stops shrinking, so a panel stays usable in a small window.
Floating panels and panels docked at the top or bottom are left alone.

Must not import torch or runtime.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QMainWindow, QWidget

__all__ = ["PANEL_FLOOR", "PanelWidthGuard", "QWIDGETSIZE_MAX"]

#: The narrowest bound (px): a panel can always be this wide, whatever the window.
PANEL_FLOOR = 240
QWIDGETSIZE_MAX = (1 << 24) - 1
_SIDES = (Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea)


class PanelWidthGuard(QObject):
    """Keeps ``chat.width() >= window.width() / 2`` by bounding the side docks' widths.

    Args:
        window: the main window whose docks are bounded.
        chat: the widget that must keep half the window (the chat column).
    """

    def __init__(self, window: QMainWindow, chat: QWidget):
        super().__init__(window)
        self.window, self.chat = window, chat
        self._wanted: dict[QDockWidget, int] = {}     # the width the user gave each panel
        self._seen: dict[QDockWidget, int] = {}       # each panel's width at the last check
        self._expected: dict[QDockWidget, int] = {}   # the width a clamp or a restore of ours gives it
        self._window_width = -1
        self._on_screen: dict[QDockWidget, bool] = {}
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self.apply)
        window.installEventFilter(self)
        chat.installEventFilter(self)

    def watch(self, dock: QDockWidget, wanted: int | None = None) -> None:
        """Bound ``dock`` too (and again whenever it is moved, floated, shown or hidden).
        ``wanted``: the width the user gave it last time (px; :meth:`widths`), kept whenever the bound allows."""
        if wanted:
            self._wanted[dock] = int(wanted)
        dock.installEventFilter(self)
        dock.dockLocationChanged.connect(self.schedule)
        dock.topLevelChanged.connect(self.schedule)
        # A panel tabbed behind another stays isVisible() with a stale width; this says whether it is on screen.
        self._on_screen[dock] = dock.isVisible()
        dock.visibilityChanged.connect(lambda on, d=dock: (self._on_screen.__setitem__(d, on), self.schedule()))
        self.schedule()

    def widths(self) -> dict[str, int]:
        """The width the user gave each panel, by object name (px): saved with the window."""
        return {dock.objectName(): width for dock, width in self._wanted.items()}

    def schedule(self, *_) -> None:
        self._timer.start()

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt API
        if event.type() in (QEvent.Type.Resize, QEvent.Type.Show, QEvent.Type.Hide):
            self.schedule()
        return False

    def bound(self) -> int:
        """The widest a side dock area may be now (px)."""
        w = self.window
        if self.chat.isHidden() or not w.isVisible():
            return QWIDGETSIZE_MAX
        areas = self._areas()
        # The chat can give up what it has above half the window; shared between the docked sides.
        spare = self.chat.width() - (w.width() + 1) // 2
        if not areas:
            return max(PANEL_FLOOR, spare)
        return max(PANEL_FLOOR, max(areas.values()) + spare // len(areas))

    def apply(self) -> None:
        """Bound every side panel; give a panel the user's width back when the bound allows it."""
        w = self.window
        if not w.isVisible():
            return
        bound = self.bound()
        resized = w.width() != self._window_width
        self._window_width = w.width()
        grow: list[tuple[QDockWidget, int]] = []
        for dock in w.findChildren(QDockWidget):
            side = not dock.isFloating() and w.dockWidgetArea(dock) in _SIDES
            limit = max(bound, dock.minimumSizeHint().width()) if side else QWIDGETSIZE_MAX
            if dock.maximumWidth() != limit:
                dock.setMaximumWidth(limit)
            if not (side and self._shown(dock)):
                continue
            width, last = dock.width(), self._seen.get(dock)
            if dock not in self._wanted:
                self._wanted[dock] = width
            elif last is not None and width != last and not resized \
                    and abs(width - self._expected.get(dock, -100)) > 2:
                for d in [dock, *w.tabifiedDockWidgets(dock)]:   # tabbed panels share one width
                    self._wanted[d] = width   # the window kept its size and we did not move it: the user did
            self._seen[dock] = width
            want = min(self._wanted[dock], limit)
            if width > limit:
                self._expected[dock] = limit
            elif want > width + 2:   # clamped earlier (a narrower window): as the user had it again
                self._expected[dock] = want
                grow.append((dock, want))
        if grow:
            w.resizeDocks([d for d, _ in grow], [n for _, n in grow], Qt.Orientation.Horizontal)

    def _areas(self) -> dict:
        """The width of each side dock area that shows a panel now."""
        w = self.window
        out: dict = {}
        for dock in w.findChildren(QDockWidget):
            area = w.dockWidgetArea(dock)
            if self._shown(dock) and not dock.isFloating() and area in _SIDES:
                out[area] = max(out.get(area, 0), dock.width())
        return out

    def _shown(self, dock: QDockWidget) -> bool:
        return dock.isVisible() and self._on_screen.get(dock, True)
