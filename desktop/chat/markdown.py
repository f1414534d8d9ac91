"""Markdown that fails gracefully: a reply's text made safe for ``QTextDocument.setMarkdown``,
the document built from it, and the code blocks found in it (for their Copy buttons).

CommonMark is strict where models are sloppy, and Qt's parser (md4c) follows it:

- a fence that is never closed runs to the end of the reply, so everything after it
  becomes one grey code box;
- a fence closed with fewer marks (``````` `` ```````, or ``````` ``` ``````` after ````````` ```` `````````),
  with text after the marks (```````` ```Now run it. ````````), or not closed before the next
  block opens (```````` ```bash ```````` inside an open ```````` ``` ````````), does not close;
- a line indented four spaces past its paragraph or list item is an indented code block;
- a list item's fence indented to the item's text with its body (and closing fence) at
  column 0, as small models write it: the body ends the item and shows as prose, and the
  closing fence opens a block over the next item;
- raw HTML blocks (``<div>``, ``<pre>``, ``<!--``) hide the text after them.

:func:`tidy_markdown` repairs these before the text is parsed, and leaves well-formed
Markdown as it is: a fence with a proper closing line is never changed; a broken one
ends at its repair (the first prose paragraph after a blank line, a fence-like line, or
the end of the text). The document is built without raw HTML (it shows as text).
Must not import torch or runtime.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from PySide6.QtGui import (
    QColor, QFont, QFontDatabase, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument,
    QTextFormat, QTextOption,
)

__all__ = ["CodeBlock", "MARKDOWN_FEATURES", "Rendered", "Tidied", "build_document", "code_blocks", "code_tint",
           "hard_breaks", "is_prose", "LINE_SEPARATOR", "tidy", "tidy_markdown"]

#: GitHub's dialect (tables, strikethrough, task lists, autolinks) without raw HTML:
#: ``<div>`` in a reply hid every line after it.
MARKDOWN_FEATURES = QTextDocument.MarkdownFeature(
    QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)

_FENCE = re.compile(r"(?P<fence>`{3,}|~{3,})(?P<info>.*)")
_LIST_ITEM = re.compile(r"(?P<marker>[-*+]|\d{1,9}[.)])(?P<gap> +|$)")
_INFO_WORD = re.compile(r"[A-Za-z0-9_+#.-]+")
_HEADING = re.compile(r"#{2,6} \S")
_NUMBERED = re.compile(r"\d{1,3}\. +(\*\*)?[A-Z]")
_SENTENCE = re.compile(r"(\*\*|_)?[A-Z][\w'’,*]*(\s+\S+){3,}")
_CODE_CHARS = set(";{}=<>$|\\")


def _expand(line: str) -> tuple[int, str]:
    """(indentation in columns, tab stops of 4; the text after it)."""
    col = 0
    for k, ch in enumerate(line):
        if ch == " ":
            col += 1
        elif ch == "\t":
            col += 4 - col % 4
        else:
            return col, line[k:]
    return col, ""


def is_prose(line: str, max_indent: int) -> bool:
    """Whether ``line`` reads as a paragraph of text, not code: a sentence of four words or
    more that starts with a capital and ends with ``. ! ? :`` and has none of ``; { } = < > $ | \\``,
    a ``##`` heading, or a numbered list item starting with a capital. At most ``max_indent``
    columns in."""
    indent, s = _expand(line)
    s = s.rstrip()
    if indent > max_indent or not s:
        return False
    if _HEADING.match(s) or _NUMBERED.match(s):
        return True
    return bool(_SENTENCE.fullmatch(s)) and s.rstrip("*_)\"'”’").endswith((".", "!", "?", ":")) \
        and not _CODE_CHARS.intersection(s)


def _fence_of(line: str) -> tuple[int, str, str] | None:
    """(indentation, fence marks, info string) of an opening fence line, else None."""
    indent, s = _expand(line)
    m = _FENCE.fullmatch(s.rstrip())
    if m is None or (m["fence"][0] == "`" and "`" in m["info"]):
        return None
    return indent, m["fence"], m["info"].strip()


def _find_end(lines: list[str], start: int, fence: str, indent: int) -> tuple[int, str, str]:
    """Where the code block opened on ``lines[start - 1]`` ends.

    Returns ``(j, how, rest)``: the block's content is ``lines[start:j]``; ``how`` says what
    ``lines[j]`` is: ``"proper"`` (a CommonMark closing line), ``"loose"`` (a closing line
    CommonMark does not accept: too few marks, or text after them, which is ``rest``),
    ``"reopen"`` (a fence with a language: the next block, opened before this one was
    closed), ``"prose"`` (a blank line before a paragraph of prose), ``"end"`` (no line).
    A proper closing line is trusted, but for one case: a ```` block with a ``` line that no
    other ``` line pairs with (a nested fence would): that line closed it, and the ```` line
    opens the next block.
    """
    mark, n = fence[0], len(fence)
    strict = re.compile(re.escape(mark) + "{%d,}\\s*" % n)
    reopen = re.compile(re.escape(mark) + "{%d}\\s*" % n + _INFO_WORD.pattern + "\\s*")
    loose = re.compile(re.escape(mark) + "{2,}")
    end, how, rest = len(lines), "end", ""
    lenient = inner = None   # the first loose line; an unmatched nested fence line
    for j in range(start, len(lines)):
        s = _expand(lines[j])[1].rstrip()
        if strict.fullmatch(s):
            if inner is not None:
                lenient = inner   # ``` under ```` that no nested fence pairs: it closed the block,
                break             # and this line opens the next one
            return j, "proper", ""
        if reopen.fullmatch(s):
            end, how = j, "reopen"
            break
        if loose.match(s):   # ``  or  ```Text after  or  ``` under ````
            lenient = j if lenient is None else lenient
            run = len(s) - len(s.lstrip(mark))
            after = s[run:].strip()
            if (run >= 3 and after and not _INFO_WORD.fullmatch(after)) or (run == 2 and not after):
                lenient = j   # ```Text after the marks, or `` alone: no code has that line; it closes here
                break
            if 3 <= run < n:
                if inner is None:
                    inner = j     # a fence nested in this one opens (or this one closes: see above)
                elif not after:
                    inner = None  # the nested fence closes
    if lenient is not None and lenient < end:   # only when no proper closing line follows
        s = _expand(lines[lenient])[1].rstrip()
        end, rest = lenient, s.lstrip(mark).strip()
        how = "reopen" if _INFO_WORD.fullmatch(rest) else "loose"
    # A broken block ends before the first paragraph of prose that follows a blank line.
    j = _prose_at(lines, start + 1, end, indent)
    return (j - 1, "prose", "") if j is not None else (end, how, rest)


def _prose_at(lines: list[str], lo: int, hi: int, indent: int) -> int | None:
    """The first ``j`` in ``[lo, hi)`` where a paragraph of prose follows a blank line."""
    for j in range(max(lo, 1), hi):
        if not lines[j - 1].strip() and is_prose(lines[j], indent):
            return j
    return None


def _strip_cols(line: str, n: int) -> str:
    """``line`` without up to ``n`` columns of leading whitespace (a code line inside its fence)."""
    col = k = 0
    while k < len(line) and line[k] in " \t":
        step = 1 if line[k] == " " else 4 - col % 4
        if col + step > n:
            break
        col += step
        k += 1
    return line[k:]


@dataclass(frozen=True)
class Tidied:
    """:func:`tidy`'s result: the repaired Markdown, and each code block's source text in
    order (as written: tabs kept, the fence's indentation removed)."""

    markdown: str
    code: tuple[str, ...]


def tidy_markdown(text: str) -> str:
    """``text`` with the breakages listed in the module docstring repaired (see :func:`tidy`)."""
    return tidy(text).markdown


def tidy(text: str) -> Tidied:
    """Repair ``text``'s Markdown (the breakages listed in the module docstring).

    Well-formed Markdown comes back unchanged but for the indentation of lines that would
    have been indented code blocks. Pure and cheap (one pass over the lines; a broken
    fence looks ahead to its end): it runs on every layout of a streaming reply.
    """
    if "``" not in text and "~~" not in text and "\n " not in text and "\n\t" not in text \
            and not text.startswith((" ", "\t")):
        return Tidied(text, ())   # no fence, no indented line: nothing to repair (most replies)
    lines = text.split("\n")
    out: list[str] = []
    code: list[str] = []
    item: int | None = None   # the content column of the innermost list item, or None
    blank = True
    i = 0
    while i < len(lines):
        line = lines[i]
        indent, body = _expand(line)
        if not body.strip():
            out.append(line)
            blank = True
            i += 1
            continue
        listed = _LIST_ITEM.match(body)
        if item is not None and blank and indent < item and not listed:
            item = None   # a paragraph after a blank line, left of the item's text: the list ended
        allowed = (item + 3) if item is not None else 3
        target = indent if indent <= allowed else (item or 0)   # never an indented code block
        fence = _fence_of(line)
        if fence is not None:
            _, marks, info = fence
            end, how, rest = _find_end(lines, i + 1, marks, indent)
            if how == "end":
                while end > i + 1 and not lines[end - 1].strip():
                    end -= 1   # blank lines at the end of an unclosed block go after it
            delta = indent - target
            # Inside a list item, small models indent the opening fence but start the body
            # (and the closing fence) at column 0: in CommonMark such a line ends the item,
            # so the code became prose and the closing fence opened a block over the next
            # item. Body lines move right together, keeping their relative indentation: by
            # the fence's column when the closing fence is left of it (the body was written
            # from column 0) unless the body starts exactly at the fence's column, else until
            # the least indented line is at the fence's column.
            shift = 0
            if item is not None and target >= item:
                cols = [_expand(lines[k])[0] for k in range(i + 1, end) if lines[k].strip()]
                closed_left = how != "end" and end < len(lines) and _expand(lines[end])[0] < target
                if cols and closed_left and min(cols) != target:
                    shift = target
                elif cols:
                    shift = max(0, target - min(cols))
            out.append(line if delta == 0 else " " * target + body)
            for k in range(i + 1, end):
                col, b = _expand(lines[k])
                out.append(" " * max(0, col - delta + shift) + b if (delta or shift) and b else lines[k])
            code.append("\n".join(_strip_cols(lines[k], indent - shift) for k in range(i + 1, end)))
            if how == "proper":
                out.append(lines[end] if _expand(lines[end])[0] == target else " " * target + marks)
                end += 1
            else:
                out.append(" " * target + marks)
                if how == "loose":
                    if rest:
                        lines[end] = rest   # the text after the closing marks: a line of its own
                    else:
                        end += 1
            i = end
            blank = False
            continue
        if listed:
            item = target + len(listed["marker"]) + max(1, len(listed["gap"]))
        out.append(line if target == indent else " " * target + body)
        blank = False
        i += 1
    return Tidied("\n".join(out), tuple(code))


#: A line that opens a block of its own (not a paragraph's next line): a list item, a heading,
#: a quote, a rule or setext underline, a table row.
_OPENS_BLOCK = re.compile(r"([-*+]|\d{1,9}[.)])( |$)|#{1,6}( |$)|>|(=+|-+|(\* *){3,}|(_ *){3,})$|\|")

#: A quote's line: its marks (``>``, ``> >``, each with at most one space after it) and the rest.
_QUOTE = re.compile(r"(?P<marks>(?:> ?)+)(?P<inner>.*)")

#: Qt lays this out as a line break inside a paragraph (QChar::LineSeparator).
LINE_SEPARATOR = "\u2028"


def _continues(body: str) -> bool:
    """Whether the line ``body`` (its indentation removed) is one a next line may continue as
    the same paragraph: prose or a list item's text, not a heading, rule, table row or quote."""
    return not (_OPENS_BLOCK.match(body) and not _LIST_ITEM.match(body)) and "|" not in body


def _unbroken(line: str) -> str:
    """``line`` without its trailing spaces and Markdown hard break (one line break is enough)."""
    line = line.rstrip()
    return line[:-1] if line.endswith("\\") and not line.endswith("\\\\") else line


def hard_breaks(markdown: str) -> str:
    """``markdown`` with each single newline inside a paragraph kept as a line break, outside
    code blocks. In CommonMark a single newline is a soft break, shown as a space: a two-line
    poem showed as one line. Chat apps (ChatGPT, LM Studio, Jan) show the lines as the model
    wrote them. The newline becomes :data:`LINE_SEPARATOR` (not a Markdown hard break: Qt makes
    that a new paragraph, as far from the line before as a blank line would). Inside a quote
    (``> ``) the same holds for the quote's lines (and a lazy line without ``>`` that continues
    its paragraph). Copy and export keep the text as written. ``markdown`` should be
    :func:`tidy`'s (fences closed)."""
    if "\n" not in markdown:
        return markdown
    out: list[str] = []
    fence: tuple[str, int] | None = None   # (mark, length) of the open code block
    joinable = False                        # out[-1] is a paragraph line the next may continue
    quoted: str | None = None               # out[-1] is such a line in a quote of these marks (">", ">>")
    qfence: tuple[str, int] | None = None   # the open code block inside the quote
    for line in markdown.split("\n"):
        body = _expand(line)[1].rstrip()
        if fence is not None:
            if body.startswith(fence[0] * fence[1]) and not body.strip(fence[0]):
                fence = None
            out.append(line)
            continue
        q = _QUOTE.match(body)
        if q is not None:
            marks, inner = q["marks"].replace(" ", ""), _expand(q["inner"])[1].rstrip()
            if qfence is not None:
                if inner.startswith(qfence[0] * qfence[1]) and not inner.strip(qfence[0]):
                    qfence = None
                out.append(line)
                continue
            opened = _fence_of(q["inner"])
            if opened is not None:
                qfence, quoted, joinable = (opened[1][0], len(opened[1])), None, False
                out.append(line)
                continue
            if inner and marks == quoted and not _OPENS_BLOCK.match(inner):
                out[-1] = _unbroken(out[-1]) + LINE_SEPARATOR + inner   # the quoted paragraph's next line
                continue
            out.append(line)
            quoted, joinable = (marks if inner and _continues(inner) else None), False
            continue
        qfence = None
        if not body:
            out.append(line)
            joinable, quoted = False, None
            continue
        opened = _fence_of(line)
        if opened is not None:
            fence, joinable, quoted = (opened[1][0], len(opened[1])), False, None
            out.append(line)
            continue
        if (joinable or quoted is not None) and not _OPENS_BLOCK.match(body):
            out[-1] = _unbroken(out[-1]) + LINE_SEPARATOR + body   # the paragraph's next line (a quote's lazy one)
            continue
        out.append(line)
        joinable, quoted = _continues(body), None
    return "\n".join(out)


@dataclass(frozen=True)
class CodeBlock:
    """A code block of a document: its first and last block numbers and its text."""

    first: int
    last: int
    text: str


def code_blocks(doc: QTextDocument, sources: tuple[str, ...] = ()) -> list[CodeBlock]:
    """The document's code blocks, in order.

    ``sources``: the code blocks' texts as written (:attr:`Tidied.code`). With them, a run
    of code lines is split where one block ends and the next begins (two blocks with no
    text between them lie in one run) and each block's text is its source (Qt shows a tab
    as spaces; a copy keeps the tab). Without them, or when the lines do not add up, each
    run is one block with the text shown.
    """
    runs: list[list] = []
    block, run = doc.begin(), []
    while block.isValid():
        if _is_code(block.blockFormat()):
            run.append(block)
        elif run:
            runs.append(run)
            run = []
        block = block.next()
    if run:
        runs.append(run)
    sizes = [src.count("\n") + 1 for src in sources]
    if sources and sum(sizes) == sum(len(r) for r in runs):
        flat = [b for r in runs for b in r]
        found, at = [], 0
        for src, size in zip(sources, sizes):
            part = flat[at: at + size]
            at += size
            if any(nb.blockNumber() != b.blockNumber() + 1 for b, nb in zip(part, part[1:])):
                break   # a block split across runs: the counts only matched by chance
            found.append(CodeBlock(part[0].blockNumber(), part[-1].blockNumber(), src))
        else:
            return found
    return [CodeBlock(r[0].blockNumber(), r[-1].blockNumber(), "\n".join(b.text() for b in r)) for r in runs]


def _is_code(fmt: QTextBlockFormat) -> bool:
    return fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.hasProperty(QTextFormat.Property.BlockCodeLanguage)


@dataclass
class Rendered:
    """A laid-out message: its document and the code blocks in it."""

    doc: QTextDocument
    code: list[CodeBlock]


def build_document(text: str, font: QFont, palette: QPalette, width: int, *, plain: bool = False,
                   code_reserve: int = 0) -> Rendered:
    """``text`` laid out ``width`` px wide: tidied Markdown (:func:`tidy`, single newlines kept
    as line breaks: :func:`hard_breaks`) with tinted
    monospace code blocks, or (``plain``) the text as it is, with no code blocks. Every line
    wraps inside ``width``, a code line too (at a space, else anywhere). ``code_reserve`` px
    are kept free at the right of each code block's first line (its Copy button's place)."""
    doc = QTextDocument()
    doc.setDefaultFont(font)
    doc.setDocumentMargin(0)
    wrap = QTextOption()
    wrap.setWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)   # a long identifier or URL too
    doc.setDefaultTextOption(wrap)
    if plain:
        doc.setPlainText(text)
        code: list[CodeBlock] = []
    else:
        tidied = tidy(text)
        doc.setMarkdown(hard_breaks(tidied.markdown), MARKDOWN_FEATURES)
        _style_code(doc, palette)
        code = code_blocks(doc, tidied.code)
        if code_reserve > 0:
            for block in code:
                bf = QTextBlockFormat()
                bf.setRightMargin(code_reserve)
                QTextCursor(doc.findBlockByNumber(block.first)).mergeBlockFormat(bf)
    doc.setTextWidth(max(40, width))
    return Rendered(doc, code)


def mix(a: QColor, b: QColor, t: float) -> QColor:
    """``a`` moved ``t`` (0..1) of the way to ``b``."""
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


def code_tint(palette: QPalette) -> QColor:
    """The background of a code block."""
    return mix(palette.color(QPalette.ColorRole.Base), palette.color(QPalette.ColorRole.Text), 0.08)


def _style_code(doc: QTextDocument, palette: QPalette) -> None:
    """Code blocks: a monospace font on a tinted background (setMarkdown gives neither a background)."""
    fixed = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    tint = code_tint(palette)
    block = doc.begin()
    while block.isValid():
        if _is_code(block.blockFormat()):
            cur = QTextCursor(block)
            bf = QTextBlockFormat()
            bf.setBackground(tint)
            bf.setLeftMargin(6)
            bf.setNonBreakableLines(False)   # Qt's import makes code lines unbreakable: they ran past the bubble
            cur.mergeBlockFormat(bf)
            cur.select(QTextCursor.SelectionType.BlockUnderCursor)
            cf = QTextCharFormat()
            cf.setFontFamilies(fixed.families())
            cur.mergeCharFormat(cf)
        block = block.next()
