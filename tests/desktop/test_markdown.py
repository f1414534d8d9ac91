"""Markdown that fails gracefully: a model's broken fences, deep indents, raw HTML and
unfinished lists never swallow the text after them into a code box, finished or while
streaming; well-formed Markdown is left as it is; code blocks keep their source for Copy."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PySide6.QtGui import QFont, QPalette

from desktop.chat.markdown import build_document, is_prose, tidy, tidy_markdown


def blocks(text: str) -> list[tuple[bool, str]]:
    """(is code, text) per block of the document the chat paints for ``text``."""
    from desktop.chat.markdown import _is_code

    doc = build_document(text, QFont(), QPalette(), 600).doc
    out, b = [], doc.begin()
    while b.isValid():
        out.append((_is_code(b.blockFormat()), b.text()))
        b = b.next()
    return out


def as_text(text: str) -> list[str]:
    return [t for code, t in blocks(text) if not code]


def as_code(text: str) -> list[str]:
    return [t for code, t in blocks(text) if code]


# ---- the cases seen, one by one --------------------------------------------------------------
@pytest.mark.parametrize("reply, code, text", [
    # A fence never closed: the code ends before the prose paragraph (CommonMark: never).
    ("Here:\n```python\nx = 1\n\nThat sets x to one.", ["x = 1"], ["Here:", "That sets x to one."]),
    # Closed with two marks, or with text after the marks, or with fewer marks than it opened with.
    ("```\ncode\n``\nAfter the code.", ["code"], ["After the code."]),
    ("```\ncode\n```After the code.", ["code"], ["After the code."]),
    ("````\ncode\n```\nAfter the code.", ["code"], ["After the code."]),
    ("````\nx = 1\n```\n\nIn between the two.\n\n````\ny = 2\n```\n\nAfter the two.", ["x = 1", "y = 2"],
     ["In between the two.", "After the two."]),
    # The next block opened before this one was closed.
    ("```python\na = 1\n```bash\nls\n```\nThe end.", ["a = 1", "ls"], ["The end."]),
    # Four spaces in: an indented code block in CommonMark.
    ("Tips:\n\n    Tip one is good.\n\nDone.", [], ["Tips:", "Tip one is good.", "Done."]),
    ("- a\n\n      deep text here\n\nEnd.", [], ["a", "deep text here", "End."]),
    ("- a\n\n          - b is nested\n\nEnd.", [], ["a", "b is nested", "End."]),
    # Raw HTML hid everything after it.
    ("<div>\n\nafter the div", [], ["<div>", "after the div"]),
    ("Use <pre>\n\n<pre>\n\nmore text", [], ["Use <pre>", "<pre>", "more text"]),
    ("<!-- a comment\n\nThe rest.", [], ["<!-- a comment", "The rest."]),
    # An unfinished list.
    ("1. First\n2.\n\nThen text.", [], ["First", "Then text."]),
])
def test_broken_markdown_keeps_the_text_after_it_as_text(qapp, reply, code, text):
    assert as_code(reply) == code
    assert as_text(reply) == text


def test_well_formed_markdown_is_left_as_it_is(qapp):
    reply = ("# Title\n\nA paragraph with `code` and **bold**.\n\n1. one\n   ```bash\n   ls\n   ```\n2. two\n"
             "    - nested\n\n````md\n```python\nx = 1\n```\n\nDear John,\n\nThank you for the letter.\n````\n\n"
             "| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert tidy_markdown(reply) == reply
    # The email inside the four-backtick block stays code: a proper closing line is trusted.
    assert "Thank you for the letter." in as_code(reply)


def test_code_blocks_keep_their_source_for_copy(qapp):
    reply = "Make:\n```make\nall:\n\tcc x.c\n```\n1. Then\n   ```bash\n   ls -la\n   ```\n```python\na\n```bash\nb\n```\n"
    r = build_document(reply, QFont(), QPalette(), 600)
    # Tabs kept (Qt shows them as spaces), the fence's indentation removed, blocks with
    # nothing between them told apart.
    assert [c.text for c in r.code] == ["all:\n\tcc x.c", "ls -la", "a", "b"]
    assert tidy(reply).code == ("all:\n\tcc x.c", "ls -la", "a", "b")


def test_a_block_being_written_is_code_until_prose_follows(qapp):
    assert as_code("Here:\n```python\ndef f():\n    return 1\n") == ["def f():", "    return 1"]
    # Python's comments and docstrings are not prose.
    assert as_code("```python\nx = 1\n\n# Compute the sum.\n\n\"\"\"Adds them all up.\"\"\"\n") == [
        "x = 1", "", "# Compute the sum.", "", '"""Adds them all up."""']


# ---- code in list items, as small models write it ------------------------------------------
#: SmolLM2-135M-Instruct's greedy reply to "Now list three ways to test it." (after "Write a Python
#: function that returns the square of a number."): each item's opening fence is indented to the
#: item's text, its body and closing fence start at column 0. CommonMark ends the item at the
#: body: the code showed as prose, the next item's title and fence in a code box.
SMOLLM2_LIST = (
    "Here are three ways to test the `square_number` function:\n\n"
    "1. **Test with a specific input**:\n   ```python\ndef square_number(num):\n    return num ** 2\n\n"
    "square_number_test = square_number(5)\nassert square_number_test == 25\n```\n\n"
    "2. **Test with a default argument**:\n   ```python\ndef square_number(num=None):\n    return num ** 2\n\n"
    "square_number_test = square_number(None)\nassert square_number_test is None\n```\n\n"
    "3. **Test with a specific input list**:\n   ```python\ndef square_number(num=None):\n    return num ** 2\n\n"
    "square_number_test = square_number([5])\nassert square_number_test == 25\n```\n\n"
    "These are just a few examples of how to test the `square_number` function. The most common way to "
    "test a function is to use a debugger to step through the code and inspect the function's output.")


def test_each_list_items_code_is_its_own_box(qapp):
    r = build_document(SMOLLM2_LIST, QFont(), QPalette(), 600)
    args = ["5", "None", "[5]"]
    defaults = ["num", "num=None", "num=None"]
    expected = [f"def square_number({d}):\n    return num ** 2\n\nsquare_number_test = square_number({a})\n"
                + ("assert square_number_test is None" if a == "None" else "assert square_number_test == 25")
                for d, a in zip(defaults, args)]
    assert [c.text for c in r.code] == expected   # three boxes, each one item's code, indentation kept
    assert as_text(SMOLLM2_LIST) == [
        "Here are three ways to test the square_number function:", "Test with a specific input:",
        "Test with a default argument:", "Test with a specific input list:",
        SMOLLM2_LIST.rsplit("\n\n", 1)[1].replace("`", "")]
    # The three items are one numbered list (1, 2, 3), each box inside its item.
    doc, numbers = r.doc, []
    b = doc.begin()
    while b.isValid():
        if b.textList() is not None and b.text().startswith("Test with"):
            numbers.append(b.textList().itemNumber(b) + 1)
        b = b.next()
    assert numbers == [1, 2, 3]


@pytest.mark.parametrize("reply, code, text", [
    # A bullet item; the closing fence at the item's column, the next item right after it.
    ("- Install it:\n  ```bash\npip install attnchat\n  ```\n- Run it:\n  ```bash\nattnchat\n```\nDone here, all set.",
     ["pip install attnchat", "attnchat"], ["Install it:", "Run it:", "Done here, all set."]),
    # A nested item; relative indentation in the body kept.
    ("1. Define it:\n   - like this:\n     ```python\ndef f():\n    return 1\n```\n2. Call it.",
     ["def f():", "    return 1"], ["Define it:", "like this:", "Call it."]),
    # Still being written: the open block belongs to its item.
    ("1. First:\n   ```python\nx = 1\ny = 2", ["x = 1", "y = 2"], ["First:"]),
])
def test_list_item_fences_with_the_body_at_column_0(qapp, reply, code, text):
    assert as_code(reply) == code
    assert as_text(reply) == text


def test_streaming_a_list_with_code_never_puts_an_item_or_a_fence_in_a_box(qapp):
    titles = ["Test with a specific input", "Test with a default argument", "Test with a specific input list"]
    ends = [k for k, ch in enumerate(SMOLLM2_LIST) if ch == "\n"] + [len(SMOLLM2_LIST)]
    for end in ends + [e - 3 for e in ends if e > 3]:   # every line end, and cuts inside lines
        head = SMOLLM2_LIST[:end]
        code, text = as_code(head), as_text(head)
        assert not any(line.lstrip().startswith(("```", "2.", "3.", "**Test", "These are")) for line in code), head
        for n, title in enumerate(titles, 1):
            if f"{n}. **{title}**:\n" in head:   # the item's line is written
                assert f"{title}:" in text, head


@pytest.mark.parametrize("line, prose", [
    ("This sets x to one.", True), ("## Explanation", True), ("1. First, install it", True),
    ("x = 1", False), ("print(x)", False), ("# Compute the sum.", False), ("Hello world!", False),
    ("    This is indented past the fence.", False), ("If x > 1: return y.", False)])
def test_what_reads_as_prose(line, prose):
    assert is_prose(line, 0) is prose


# ---- generated replies ---------------------------------------------------------------------
words = st.lists(st.sampled_from(["the", "river", "runs", "past", "old", "town", "walls", "at", "night"]),
                 min_size=3, max_size=8).map(" ".join)
code_lines = st.lists(st.sampled_from(["x = 1", "print(x)", "def f(a):", "    return a + 1", "ls -la",
                                       "}", "for i in range(3):", "", "# a comment"]), min_size=1, max_size=4)


@st.composite
def prose(draw, n):
    """A paragraph of prose with a unique marker word (so it can be found again)."""
    return f"Zq{n} {draw(words)}{draw(st.sampled_from(['.', '!', '?', ':']))}"


@st.composite
def broken(draw):
    """A piece of Markdown a model might write wrong, and the code lines that must stay code."""
    body = draw(code_lines)
    code = "\n".join(body)
    # Not generated: ```` closed by ``` with other fences after it (a nested fence can look
    # just like that; the parametrized cases above have it alone and twice).
    kind = draw(st.sampled_from(["short", "reopen", "indent", "listdeep", "html", "list", "listcode", "fine"]))
    if kind == "short":
        return f"```\n{code}\n``", body
    if kind == "reopen":
        return f"```python\n{code}\n```bash\n{code}\n```", body
    if kind == "indent":
        return f"    {draw(words)}", []
    if kind == "listdeep":
        return f"- item\n\n        {draw(words)}", []
    if kind == "html":
        return draw(st.sampled_from(["<div>", "<pre>", "<!-- note", "<script>"])), []
    if kind == "list":
        return "1. First\n2.", []
    if kind == "listcode":   # the fence indented to the item's text, the body (from column 0) and closing fence not
        marker = draw(st.sampled_from(["1.", "-", "10."]))
        pad = " " * (len(marker) + 1)
        close = draw(st.sampled_from(["```", pad + "```"]))
        body = ["x = 0", *body]   # as models write it: the first line at column 0
        return f"{marker} Step:\n{pad}```python\n" + "\n".join(body) + f"\n{close}\n{marker} Next step", body
    return f"```python\n{code}\n```", body


@st.composite
def reply(draw):
    """Prose paragraphs between broken pieces; maybe an unclosed fence or a closing line with
    text after it; returns (reply, prose paragraphs)."""
    parts, paragraphs = [], []
    for n in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            parts.append(draw(broken())[0])
        p = draw(prose(n))
        paragraphs.append(p)
        if draw(st.booleans()) and parts and parts[-1].startswith("```\n") and parts[-1].endswith("\n``"):
            parts[-1] = parts[-1] + "`" + p   # ```Text after the marks
        else:
            parts.append(p)
    if draw(st.booleans()):   # an unclosed fence, then a last paragraph
        parts.append("```python\n" + "\n".join(draw(code_lines)))
        paragraphs.append(draw(prose(99)))
        parts.append(paragraphs[-1])
    return "\n\n".join(parts), paragraphs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=reply())
def test_prose_after_broken_markdown_is_rendered_as_text(qapp, data):
    text, paragraphs = data
    shown = as_text(text)
    for p in paragraphs:
        assert p in shown, f"{p!r} was not shown as text in {text!r}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=reply(), cuts=st.lists(st.floats(0, 1), min_size=1, max_size=4))
def test_while_streaming_every_finished_paragraph_is_text(qapp, data, cuts):
    text, paragraphs = data
    for cut in cuts:
        head = text[: int(len(text) * cut)]
        shown = as_text(head)
        for p in paragraphs:
            if p in head:
                assert p in shown, f"{p!r} was not shown as text while streaming {head!r}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(broken(), min_size=1, max_size=4))
def test_code_inside_fences_stays_code(qapp, pieces):
    text = "\n\n".join(p for p, _ in pieces if "```" in p)
    code = as_code(text)
    for piece, body in pieces:
        if "```" in piece:
            for line in filter(None, body):
                assert line in code
    assert not any("Step" in line for line in code)   # a list item's text is never code


def test_single_newlines_in_a_reply_are_shown_as_line_breaks(qapp):
    """A two-line poem shows as two lines of one paragraph (not one line, not two paragraphs);
    lists, tables, headings and code keep their Markdown meaning."""
    from PySide6.QtGui import QFont, QPalette

    from desktop.chat.markdown import LINE_SEPARATOR, build_document, hard_breaks

    poem = "Roses are red,\nviolets are blue.\n\nSugar is sweet,\nand so are you."
    doc = build_document(poem, QFont(), QPalette(), 600).doc
    doc.documentLayout().documentSize()   # lay it out
    blocks = [doc.findBlockByNumber(i) for i in range(doc.blockCount())]
    assert [b.text() for b in blocks] == [f"Roses are red,{LINE_SEPARATOR}violets are blue.",
                                          f"Sugar is sweet,{LINE_SEPARATOR}and so are you."]
    assert [b.layout().lineCount() for b in blocks] == [2, 2]
    assert hard_breaks("Intro:\n- a\n  more\n- b") == f"Intro:\n- a{LINE_SEPARATOR}more\n- b"
    table = "| a | b |\n|---|---|\n| 1 | 2 |"
    assert hard_breaks(table) == table and hard_breaks("Title\n---\nbody") == "Title\n---\nbody"
    assert hard_breaks("```\nx = 1\ny = 2\n```\nafter\nline") == f"```\nx = 1\ny = 2\n```\nafter{LINE_SEPARATOR}line"
    assert hard_breaks("ends in a break\\\nnext") == f"ends in a break{LINE_SEPARATOR}next"


def test_single_newlines_in_a_quote_are_shown_as_line_breaks(qapp):
    """A quoted two-line poem showed as one line: the quote's lines joined as CommonMark's soft
    break does. Its code, headings and lists keep their meaning; a quote inside a quote too."""
    from desktop.chat.markdown import LINE_SEPARATOR as LS, hard_breaks

    def shown(text):
        doc = build_document(text, QFont(), QPalette(), 600).doc
        doc.documentLayout().documentSize()
        return [(doc.findBlockByNumber(i).text(), doc.findBlockByNumber(i).layout().lineCount())
                for i in range(doc.blockCount())]

    assert shown("> Roses are red,\n> violets are blue.") == [(f"Roses are red,{LS}violets are blue.", 2)]
    assert shown("As she wrote:\n> one\n> two\nlazy three\n\nAfter.") == [
        ("As she wrote:", 1), (f"one{LS}two{LS}lazy three", 3), ("After.", 1)]
    assert hard_breaks(">> deep\n>> deeper\n> out") == f">> deep{LS}deeper\n> out"
    for kept in ("> # Title\n> body", "> ```\n> x = 1\n> y = 2\n> ```", "> | a | b |\n> |---|---|",
                 "> a\n>\n> b", "> - one\n> - two", "> text\n# Heading"):
        assert hard_breaks(kept) == kept, kept
    assert hard_breaks("> - one\n>   more") == f"> - one{LS}more"
    assert hard_breaks("> ```\n> x = 1\n> ```\n> after\n> line") == f"> ```\n> x = 1\n> ```\n> after{LS}line"
