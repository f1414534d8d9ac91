"""The mouse wheel scrolls; it never changes a setting under the pointer.

Qt gives a combo box, a spin box or a slider the wheel whenever the pointer is over it, so
scrolling a long form (Settings, a panel's controls) changed whichever value passed under
the pointer ("Plan for" in the memory planner). Here such a widget takes the wheel only
while it has the keyboard focus (clicked or tabbed to, as in Firefox's and GNOME's forms);
otherwise the wheel goes to the scroll area around it. Their focus policy becomes
``StrongFocus``, so the wheel no longer gives them the focus either.

Imports Qt only.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSlider, QAbstractSpinBox, QApplication, QComboBox, QWidget

__all__ = ["WheelGuard", "install_wheel_guard", "GUARDED"]

#: The widgets whose value a wheel turn changes.
GUARDED = (QComboBox, QAbstractSpinBox, QAbstractSlider)


def _guarded(obj: QObject) -> QWidget | None:
    """The value widget ``obj`` is (a scroll bar is not one) or edits (a spin box's line edit), else None."""
    if isinstance(obj, QWidget) and isinstance(obj.parentWidget(), QAbstractSpinBox):
        obj = obj.parentWidget()   # the spin box's own line edit
    if isinstance(obj, GUARDED) and not obj.inherits("QScrollBar"):
        return obj
    return None


def _scroll_area_of(w: QWidget) -> QAbstractScrollArea | None:
    """The nearest scroll area around ``w`` whose contents ``w`` is in (not a combo box's list)."""
    p = w.parentWidget()
    while p is not None and not p.isWindow():
        if isinstance(p, QAbstractScrollArea) and p.viewport().isAncestorOf(w):
            return p
        p = p.parentWidget()
    return None


class WheelGuard(QObject):
    """An application-wide event filter (one per application: :func:`install_wheel_guard`)."""

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt API
        kind = event.type()
        if kind == QEvent.Type.Wheel:
            w = _guarded(obj)
            if w is not None and not w.hasFocus():
                area = _scroll_area_of(w)
                if area is not None:   # handed over explicitly: Qt 6 does not pass on a synthetic wheel
                    QApplication.sendEvent(area.viewport(), event.clone())
                    return True
                event.ignore()   # ignored and filtered: Qt passes a real wheel on to the parents
                return True
        elif kind == QEvent.Type.Polish:
            w = _guarded(obj)
            if w is not None and w.focusPolicy() == Qt.FocusPolicy.WheelFocus:
                w.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        return False


def install_wheel_guard(app: QApplication | None = None) -> WheelGuard | None:
    """Install the guard on ``app`` (default: the running one) once; returns it (None: no app)."""
    app = app or QApplication.instance()
    if app is None:
        return None
    guard = getattr(app, "_attnchat_wheel_guard", None)
    if guard is None:
        guard = WheelGuard(app)
        app.installEventFilter(guard)
        app._attnchat_wheel_guard = guard
    return guard
