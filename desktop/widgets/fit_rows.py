"""A table whose rows stay as tall as their wrapped text when its width changes.

``QTableView.resizeRowsToContents`` sizes the rows once, for the columns' widths of that
moment; a dock or dialog that is laid out (or resized) afterwards narrows a stretched column
and its wrapped text is cut ("grouped-query (this …", "top induction: 18.6 17.3 …").
:func:`fit_rows` resizes the rows again after each change of the table's width.

:func:`whole_columns` keeps every column as wide as its header and cells: in a narrow dock a
table that does not fit scrolls sideways instead of cutting its headers ("ecode ste",
"hole mod") and cells ("<|i...").

Imports Qt only.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableView

__all__ = ["fit_rows", "whole_columns"]


class _RowFitter(QObject):
    def __init__(self, table: QTableView, after: Callable[[], None] | None):
        super().__init__(table)
        self.table, self.after = table, after

    def fit(self) -> None:
        self.table.resizeRowsToContents()
        if self.after is not None:
            self.after()

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt API
        if event.type() == QEvent.Type.Resize and event.size().width() != event.oldSize().width():
            QTimer.singleShot(0, self, self.fit)   # after the header has stretched its columns
        return False


def fit_rows(table: QTableView, after: Callable[[], None] | None = None) -> Callable[[], None]:
    """Keep ``table``'s rows fitted to their wrapped text; ``after`` runs after each fit (e.g.
    to size the table to its rows). Returns the fit, to call after filling the table."""
    table.setWordWrap(True)
    fitter = _RowFitter(table, after)
    table.installEventFilter(fitter)
    return fitter.fit


def whole_columns(table: QTableView) -> None:
    """Size each of ``table``'s columns to its header and cells; a table wider than its view
    scrolls sideways (per pixel). No column stretches: a stretched last column kept 100 px
    (the header's default) when the view narrowed, and pushed the table past its view."""
    head = table.horizontalHeader()
    head.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    head.setStretchLastSection(False)
    table.setHorizontalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
