"""The colour of an error's text on the palette it is drawn on (Qt only).

A dark red reads on a light window (#b3261e on Fusion's #efefef: 5.5:1) but not on a dark one
(on the dark palette's #2b2b2b: 2.2:1); there a light red does (#ff7b72: 5.6:1). WCAG 2.1 AA
asks 4.5:1 of body text (https://www.w3.org/TR/WCAG21/#contrast-minimum).
"""
from __future__ import annotations

from PySide6.QtGui import QPalette

__all__ = ["ERROR_ON_DARK", "ERROR_ON_LIGHT", "error_text_color"]

ERROR_ON_LIGHT = "#b3261e"
ERROR_ON_DARK = "#ff7b72"


def error_text_color(palette: QPalette) -> str:
    """The error text colour (``#rrggbb``) for text on ``palette``'s window colour."""
    dark = palette.color(QPalette.ColorRole.Window).lightness() < 128
    return ERROR_ON_DARK if dark else ERROR_ON_LIGHT
