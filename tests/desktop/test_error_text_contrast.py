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
    text = label.palette().color(QPalette.ColorRole.WindowText)
    ground = w.page.palette().color(QPalette.ColorRole.Window)
    assert text.red() > max(text.green(), text.blue()) + 60   # still red
    assert contrast(text, ground) >= 4.5, (text.name(), ground.name())


def test_the_error_colour_reads_on_either_palette(qapp):
    from desktop.widgets.colors import error_text_color

    for palette in (qapp.style().standardPalette(), dark_palette()):
        assert contrast(QColor(error_text_color(palette)), palette.color(QPalette.ColorRole.Window)) >= 4.5


def _ink(image, ground: QColor) -> QColor:
    """The pixel of ``image`` farthest from ``ground`` (a glyph's stem)."""
    best, far = ground, -1
    for y in range(image.height()):
        for x in range(image.width()):
            c = image.pixelColor(x, y)
            d = abs(c.red() - ground.red()) + abs(c.green() - ground.green()) + abs(c.blue() - ground.blue())
            if d > far:
                best, far = c, d
    return best


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("kind", ["note", "error"])
def test_a_link_in_the_notice_reads_on_its_own_background(qtbot, make_window, request, theme, kind):
    """The notice has its own colours (dark on pale yellow, white on red) but its links took the
    window's: the dark palette's light blue on the note's pale yellow was 2.2:1."""
    from PySide6.QtWidgets import QApplication

    # As ATTNCHAT_THEME=dark does: the application's palette (a widget's own is not used under a style sheet).
    if theme == "dark":
        kept = QApplication.palette()
        QApplication.setPalette(dark_palette())
        request.addfinalizer(lambda: QApplication.setPalette(kept))
    from desktop.chat.pages import notice_link
    from desktop.main_window.replies import CONTEXT_FULL

    w = make_window()
    if kind == "note":   # the first start's recommendation, its link alone
        w.show_note(notice_link("recommend", "Download SmolLM2-1.7B-Instruct (1,010.9 MiB)", "note"))
    else:   # the full context's first link, alone
        link = notice_link("new", "start a new chat", "error")
        assert link in CONTEXT_FULL
        w.show_error(link)
    qtbot.waitUntil(lambda: w.notice.isVisible() and w.notice.width() > 100, timeout=2000)
    image = w.notice.grab().toImage()
    ground = image.pixelColor(3, image.height() // 2)   # inside the padding
    assert contrast(_ink(image, ground), ground) >= 4.5
