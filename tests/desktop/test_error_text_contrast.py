"""Red text the user must read (a message too long for the context, a setting's error) reads
on the palette it is drawn on: the light palette's dark red on the dark palette's grey was
2.2:1, under the 4.5:1 that WCAG AA asks of text."""
from __future__ import annotations

import pytest
from PySide6.QtGui import QColor, QPalette

from desktop.app import dark_palette


def contrast(a: QColor, b: QColor) -> float:
    """WCAG 2's contrast ratio of two colours (1 to 21)."""
    def lum(c: QColor) -> float:
        ch = [v / 255 for v in (c.red(), c.green(), c.blue())]
        ch = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in ch]
        return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_too_long_count_reads_in_both_palettes(qtbot, make_window, theme):
    w = make_window()
    if theme == "dark":
        w.setPalette(dark_palette())
    label = w.page.token_count
    with qtbot.waitSignal(w.engine.counted, timeout=5000):
        w.input.setPlainText(" ".join(["word"] * 2000))   # the fake session: a token a character
    qtbot.waitUntil(lambda: label.text().endswith("too long for the context"), timeout=2000)
    label.ensurePolished()
    text, ground = label.palette().color(QPalette.ColorRole.WindowText), w.page.palette().color(QPalette.ColorRole.Window)
    assert text.red() > max(text.green(), text.blue()) + 60   # still red
    assert contrast(text, ground) >= 4.5, (text.name(), ground.name())


def test_the_error_colour_reads_on_either_palette(qapp):
    from desktop.widgets.colors import error_text_color

    for palette in (qapp.style().standardPalette(), dark_palette()):
        assert contrast(QColor(error_text_color(palette)), palette.color(QPalette.ColorRole.Window)) >= 4.5
