"""A Markdown export keeps each message's code inside that message: a reply stopped (or cut at
its length limit) inside a code block leaves its fence open, and unclosed, every section of the
exported file after it ("## You", the next replies) would render inside that code block (one
grey code box in a Markdown viewer).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from PySide6.QtGui import QTextDocument

from desktop.chat.export import conversation_markdown


def _msg(role, content):
    return SimpleNamespace(role=role, content=content, stats={})


def _code_of(markdown: str) -> list[str]:
    """The text of each code block Qt's Markdown parser (md4c, CommonMark) finds."""
    doc = QTextDocument()
    doc.setMarkdown(markdown)
    blocks, b = [], doc.begin()
    while b.isValid():
        if b.blockFormat().hasProperty(b.blockFormat().Property.BlockCodeFence) or \
                b.blockFormat().nonBreakableLines():
            blocks.append(b.text())
        b = b.next()
    return blocks


STOPPED = "Here is the code:\n```python\ndef brew():\n    print(\"Brewing Green Tea"


@pytest.mark.parametrize("fence", ["```", "~~~~", "   ```"])
def test_an_unclosed_fence_ends_with_its_message(qapp, fence):
    text = STOPPED.replace("```", fence.strip()).replace("\n" + fence.strip(), "\n" + fence)
    md = conversation_markdown(SimpleNamespace(title="Tea"), [
        _msg("user", "Brew tea in Python"), _msg("assistant", text),
        _msg("user", "Reverse a string"), _msg("assistant", "Use `s[::-1]`."),
    ])
    code = "\n".join(_code_of(md))
    assert "Brewing Green Tea" in code                  # the stopped code is still code
    assert "Reverse a string" not in code and "## You" not in code and "s[::-1]" not in code
    assert md.count("## You") == 2 and md.rstrip().endswith("Use `s[::-1]`.")


def test_closed_fences_are_left_as_written():
    text = "Run:\n```bash\nls\n```\nthen\n~~~\nx ``` y\n~~~\n"
    md = conversation_markdown(SimpleNamespace(title="T"), [_msg("assistant", text)])
    assert md == "# T\n\n## Assistant\n\n" + text.rstrip() + "\n"


def test_a_list_items_indented_fences_close_and_add_nothing():
    text = "1. Slice:\n    ```python\n    s[::-1]\n    ```\n2. Join:\n   ```python\nreversed(s)\n```"
    md = conversation_markdown(SimpleNamespace(title="T"), [_msg("assistant", text)])
    assert md.endswith(text + "\n")
