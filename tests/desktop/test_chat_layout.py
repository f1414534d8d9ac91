"""How a message is laid out in a narrow chat column (real widgets, checked on the
painted pixels): the header's name, note and buttons never overlap, and a long code
line stays inside its bubble."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QRect
from PySide6.QtGui import QColor, QImage, QPalette

from desktop.chat.view import ChatView, MessageListModel

LONG_CODE = ("Here it is:\n```python\ndef add_two_numbers(num1, num2):\n    return num1 + num2\n\n"
             "add_two_numbers_comprehension = lambda num1, num2: num1 + num2  # the same, as one long line\n```\n")
STATS = {"completion_tokens": 47, "decode_tokens_per_s": 0.7}


@pytest.fixture
def chat(qtbot):
    model = MessageListModel()
    view = ChatView()
    view.setModel(model)
    qtbot.addWidget(view)
    model.append("user", "What is the capital of France? Answer with a short list of three facts.")
    model.append("assistant", "1. Paris.\n2. On the Seine.\n3. Big.", finish_reason="stop",
                 stats={"completion_tokens": 37, "decode_tokens_per_s": 0.5})
    model.append("user", "Write a Python function that adds two numbers.")
    model.append("assistant", LONG_CODE, finish_reason="cancelled", stats=STATS)
    model.append("assistant", "Writing", streaming=True)
    view.show()
    return view


def _layout(qtbot, view: ChatView, width: int) -> QImage:
    view.resize(width, 900)
    view.doItemsLayout()
    qtbot.waitUntil(lambda: view.viewport().width() <= width, timeout=2000)
    view.scrollToTop()
    return view.viewport().grab().toImage()


def _ink_columns(image: QImage, y0: int, y1: int, x0: int, x1: int, bg: QColor) -> list[int]:
    """The x in [x0, x1] where some pixel of rows [y0, y1] is far from ``bg`` (text or a button's edge)."""
    out = []
    for x in range(x0, x1 + 1):
        for y in range(y0, y1 + 1):
            c = image.pixelColor(x, y)
            if abs(c.red() - bg.red()) + abs(c.green() - bg.green()) + abs(c.blue() - bg.blue()) > 90:
                out.append(x)
                break
    return out


@pytest.mark.parametrize("width", [250, 330, 430, 600])
def test_the_header_never_draws_one_part_over_another(qtbot, chat, width):
    image = _layout(qtbot, chat, width)
    bg = chat.palette().color(QPalette.ColorRole.Base)
    for row in (1, 3, 4):   # a finished reply, a stopped one, the one being written
        head = chat.header(row)
        parts = [head.name_rect] + ([head.note_rect] if head.note else []) + [b.rect for b in head.buttons]
        for i, a in enumerate(parts):
            for b in parts[i + 1:]:
                assert not a.intersects(b), (width, row, head)
        assert head.name.startswith(("Assistant", "Ass")) and head.note   # something readable is left
        # What is painted stays in those rectangles: every inked column of each header line lies in one.
        line1 = QRect(head.name_rect.left(), head.name_rect.top(), chat.viewport().width(), head.name_rect.height())
        if chat.visualRect(chat.model().index(row, 0)).bottom() >= image.height():
            continue
        for y0 in ([line1.top()] if head.lines == 1 else [line1.top(), head.note_rect.top()]):
            on_line = [r for r in parts if r.top() == y0]
            for x in _ink_columns(image, y0 + 4, y0 + line1.height() - 4, line1.left(),
                                  chat.viewport().width() - 2 * (chat.delegate().MARGIN + chat.delegate().PAD) + line1.left() - 1, bg):
                assert any(r.left() - 1 <= x <= r.right() + 1 for r in on_line), (width, row, x, head)


def test_the_note_stays_beside_the_name_when_it_fits_and_moves_under_it_when_not(qtbot, chat):
    _layout(qtbot, chat, 700)
    wide = chat.header(3)
    assert wide.lines == 1 and wide.note == "stopped · 47 tokens · 0.7 tok/s"
    _layout(qtbot, chat, 330)
    narrow = chat.header(3)
    assert narrow.lines == 2 and narrow.note == "stopped · 47 tokens · 0.7 tok/s"   # whole, on its own line
    assert narrow.note_rect.top() > narrow.name_rect.bottom()
    # The text below moved down with it: the first code block's button sits under the note.
    code = [b for b in chat.buttons(3) if b.name == "code"]
    assert code and code[0].rect.top() > narrow.note_rect.bottom()


def test_a_long_code_line_wraps_inside_its_bubble(qtbot, chat):
    image = _layout(qtbot, chat, 430)
    index = chat.model().index(3, 0)
    option_rect = chat.visualRect(index)
    rendered = chat.delegate().content(chat._option(index), index)
    assert rendered.doc.size().width() <= rendered.doc.textWidth() + 0.5
    block = rendered.doc.findBlockByNumber(rendered.code[0].last)
    assert block.text().startswith("add_two_numbers_comprehension") and block.layout().lineCount() >= 2
    # The "Copy code" button covers no code: the first line wraps before it.
    button = [b for b in chat.buttons(3) if b.name == "code"][0]
    first = rendered.doc.findBlockByNumber(rendered.code[0].first)
    origin_x = option_rect.left() + chat.delegate().MARGIN + chat.delegate().PAD
    assert first.text().startswith("def add_two_numbers")
    for k in range(first.layout().lineCount()):
        line = first.layout().lineAt(k)
        if k == 0 or line.y() < button.rect.height():
            assert origin_x + first.layout().position().x() + line.x() + line.naturalTextWidth() < button.rect.left()
    # Nothing is painted between the bubble's right edge and the view's: the margin stays blank.
    bg = chat.palette().color(QPalette.ColorRole.Base)
    right = option_rect.right() - chat.delegate().MARGIN
    assert not _ink_columns(image, option_rect.top() + 8, min(option_rect.bottom(), image.height() - 1) - 8,
                            right + 2, chat.viewport().width() - 1, bg)
