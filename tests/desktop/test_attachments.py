"""Files in a message: read (text, code, Markdown, PDF; the rest refused in one line), shown as
chips with their tokens, counted with the message against the context, sent, and given back
with the text when the message is refused."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication, QToolButton

from desktop.chat.attachments import AttachmentError, message_text, read_attachment
from tests.desktop.pdf_files import write_pdf


def test_files_are_read_as_their_kind(tmp_path):
    code = tmp_path / "fib.py"
    code.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    md = tmp_path / "notes.md"
    md.write_text("# Notes\n\n```sh\nls\n```\n", encoding="utf-8")
    pdf = write_pdf(tmp_path / "paper.pdf", ["Attention is all you need", "Page two"])
    a, b, c = read_attachment(code), read_attachment(md), read_attachment(pdf)
    assert (a.kind, a.language, b.kind, c.kind, c.pages) == ("code", "python", "markdown", "pdf", 2)
    assert c.text == "Attention is all you need\n\nPage two"
    msg = message_text("What does it do?", [a, b])
    assert msg.startswith("File fib.py:\n```python\ndef fib(n):")
    # The Markdown's own fence cannot close the block: the block's fence is longer.
    assert "File notes.md:\n````markdown\n# Notes" in msg and msg.endswith("````\n\nWhat does it do?")


@pytest.mark.parametrize("content,why", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is not a text, code, Markdown or PDF file (it holds binary data)"),
    ("caf\xe9".encode("latin-1"), "is not UTF-8 text; save it as UTF-8"),
    (b"  \n", "is empty"),
])
def test_what_cannot_go_in_says_why(tmp_path, content, why):
    f = tmp_path / "x.txt"
    f.write_bytes(content)
    with pytest.raises(AttachmentError, match=why.replace("(", r"\(").replace(")", r"\)")):
        read_attachment(f)


def test_a_pdf_without_text_or_damaged_is_refused(tmp_path):
    with pytest.raises(AttachmentError, match="no text layer"):
        read_attachment(write_pdf(tmp_path / "scan.pdf", [""]))
    (tmp_path / "bad.pdf").write_bytes(b"%PDF-1.4 not really")
    with pytest.raises(AttachmentError, match="could not be read as a PDF"):
        read_attachment(tmp_path / "bad.pdf")
    with pytest.raises(AttachmentError, match="is not a file"):
        read_attachment(tmp_path)


def test_attached_files_are_counted_sent_and_given_back(qtbot, make_window, tmp_path):
    w = make_window()
    notes = tmp_path / "notes.txt"
    notes.write_text("one two three four five")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00")
    with qtbot.waitSignal(w.engine.counted, timeout=5000):
        refused = w.attachments.add_paths([str(notes), str(tmp_path / "image.png")])
    assert len(refused) == 1 and "image.png is not a text" in w.page.notice.text()
    # The bar is rebuilt when the count arrives: the chip it replaces is deleted on a later
    # event-loop turn (deleteLater), so wait for the one chip with its count.
    def one_counted_chip() -> bool:
        found = w.page.attachments_bar.findChildren(QToolButton)
        return len(found) == 1 and "tokens" in found[0].text()

    qtbot.waitUntil(one_counted_chip, timeout=10_000)
    chip = w.page.attachments_bar.findChildren(QToolButton)[0].text()
    assert w.page.attachments_bar.isVisible()
    assert chip.startswith("notes.txt · 23 B · ") and chip.endswith(" tokens  ✕")
    # The count under the box counts the file with the typed words.
    want = len(w.attachments.message("summarise this").split())   # the fake tokenizer: a token a word
    # (a count of the file alone, asked when it was attached, may still be on its way)
    with qtbot.waitSignal(w.engine.counted, timeout=10_000, check_params_cb=lambda d: d["message_tokens"] == want):
        w.input.setPlainText("summarise this")
    qtbot.waitUntil(lambda: w.page.token_count.text().startswith(f"{want} tokens · prompt "), timeout=5000)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.input.submit()
    sent = [m.content for m in w.store.messages(w.current_conversation) if m.role == "user"][-1]
    assert sent == "File notes.txt:\n```\none two three four five\n```\n\nsummarise this"
    assert w.store.conversation(w.current_conversation).title == "summarise this"   # not "File notes.txt:"
    assert w.attachments.files == [] and not w.page.attachments_bar.isVisible() and not w.input.allow_empty


def test_a_file_alone_can_be_sent_and_a_chip_takes_it_out(qtbot, make_window, tmp_path):
    w = make_window()
    f = tmp_path / "a.md"
    f.write_text("# A")
    w.attachments.add_paths([str(f)])
    assert w.input.allow_empty
    chip = w.page.attachments_bar.findChildren(QToolButton)[0]
    chip.click()
    assert w.attachments.files == [] and not w.input.allow_empty
    w.attachments.add_paths([str(f)])
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.send_button.click()   # nothing typed: the file is the message
    assert [m.content for m in w.store.messages(w.current_conversation)][0] == "File a.md:\n```markdown\n# A\n```"
    assert w.store.conversation(w.current_conversation).title == "a.md"


def test_a_dropped_file_is_attached(qtbot, make_window, tmp_path):
    w = make_window()
    f = tmp_path / "drop.py"
    f.write_text("print(1)\n")
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(str(f))])
    enter = QDragEnterEvent(QPoint(5, 5), Qt.DropAction.CopyAction, data, Qt.MouseButton.NoButton,
                            Qt.KeyboardModifier.NoModifier)
    assert QApplication.sendEvent(w.input.viewport(), enter) and enter.isAccepted()
    drop = QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, data, Qt.MouseButton.NoButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(w.input.viewport(), drop)   # Qt delivers a drop only after an accepted enter
    assert [a.name for a in w.attachments.files] == ["drop.py"] and w.input.toPlainText() == ""
