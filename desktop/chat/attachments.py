"""Files in a message: text, code, Markdown and PDF files read into the message they go with.

A file attached to (or dropped on) the message box is read here, whole, before the message is
sent; its text goes into the message as a fenced block under its name, before what was typed,
as LM Studio and Jan put a file's text into the prompt (there is no retrieval: the model reads
the whole file, so it must fit the context, and the token count under the box says whether it
does). PDFs are read with pypdf (their text layer; a scanned PDF without one is refused).

No Qt, no torch. Every refusal is one :class:`AttachmentError` line that says what was wrong
and what to do.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["Attachment", "AttachmentError", "MAX_PDF_BYTES", "MAX_TEXT_BYTES", "message_text", "read_attachment"]

#: A text file past this is refused (2 MiB is about 500,000 tokens: past any context here).
MAX_TEXT_BYTES = 2 << 20
#: A PDF past this is refused before it is parsed (its text is usually a small share of it).
MAX_PDF_BYTES = 64 << 20
#: The most pages read from one PDF.
MAX_PDF_PAGES = 2000

#: Code files by suffix, with the Markdown fence's language name.
CODE = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".ts": "typescript",
    ".tsx": "tsx", ".jsx": "jsx", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp",
    ".rs": "rust", ".go": "go", ".java": "java", ".kt": "kotlin", ".swift": "swift", ".rb": "ruby",
    ".php": "php", ".cs": "csharp", ".sh": "bash", ".bash": "bash", ".zsh": "zsh", ".ps1": "powershell",
    ".sql": "sql", ".html": "html", ".css": "css", ".scss": "scss", ".json": "json", ".yaml": "yaml",
    ".yml": "yaml", ".toml": "toml", ".ini": "ini", ".cfg": "ini", ".xml": "xml", ".lua": "lua",
    ".r": "r", ".jl": "julia", ".m": "matlab", ".scala": "scala", ".dart": "dart", ".tex": "latex",
    ".cmake": "cmake", ".mk": "make", ".dockerfile": "dockerfile", ".csv": "csv", ".tsv": "tsv",
}
MARKDOWN = {".md", ".markdown", ".mdown", ".rst"}
#: Suffixes that are text without a language: read as text.
TEXT = {".txt", ".text", ".log", ".out", ".srt", ".vtt", ""}
#: What the refusal of an unknown file names as accepted.
KINDS_WORDS = "text, code, Markdown or PDF"


class AttachmentError(ValueError):
    """A file that cannot go into a message (one line: what and what to do)."""


@dataclass(frozen=True)
class Attachment:
    """A file read for a message.

    Attributes:
        name: the file's name (no folder). path: where it was read.
        kind: ``"text"``, ``"code"``, ``"markdown"`` or ``"pdf"``; language: the fence's
            language for code (``"python"``), else "".
        text: its text (a PDF's pages joined by blank lines). size_bytes: the file's size.
        pages: a PDF's page count (None for the others).
    """

    name: str
    path: str
    kind: str
    language: str
    text: str
    size_bytes: int
    pages: int | None = None

    def block(self) -> str:
        """The file as it goes into the message: its name, then its text in a fence longer than
        any run of backticks inside it (so the file cannot close the fence)."""
        longest = max((len(m) for m in re.findall(r"`+", self.text)), default=0)
        fence = "`" * max(3, longest + 1)
        lang = self.language or ("markdown" if self.kind == "markdown" else "")
        return f"File {self.name}:\n{fence}{lang}\n{self.text.rstrip()}\n{fence}"


def _kind(path: Path) -> tuple[str, str]:
    suffix = path.suffix.lower()
    if path.name.lower() in ("dockerfile", "makefile"):
        return "code", path.name.lower()
    if suffix == ".pdf":
        return "pdf", ""
    if suffix in MARKDOWN:
        return "markdown", ""
    if suffix in CODE:
        return "code", CODE[suffix]
    return "text", ""   # anything else is read as text if it is UTF-8 without NULs (README, LICENSE, .env.example)


def _decode(data: bytes, name: str) -> str:
    if b"\x00" in data[:8192]:
        raise AttachmentError(f"{name} is not a {KINDS_WORDS} file (it holds binary data); attach the text itself")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise AttachmentError(f"{name} is not UTF-8 text; save it as UTF-8 and attach it again") from None
    return text.replace("\r\n", "\n")


def _read_pdf(path: Path, name: str) -> tuple[str, int]:
    try:
        import pypdf
    except ImportError:
        raise AttachmentError("reading PDFs needs the pypdf package, which is missing from this installation; "
                              "install attnchat's requirements again (make venv)") from None
    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted:
            raise AttachmentError(f"{name} is encrypted; save an unlocked copy and attach that")
        pages = reader.pages
        if len(pages) > MAX_PDF_PAGES:
            raise AttachmentError(f"{name} has {len(pages):,} pages, more than {MAX_PDF_PAGES:,}; attach the part you need")
        texts = [(p.extract_text() or "").strip() for p in pages]
    except AttachmentError:
        raise
    except Exception as exc:  # noqa: BLE001 - pypdf raises many kinds for a damaged file
        raise AttachmentError(f"{name} could not be read as a PDF ({type(exc).__name__}); "
                              "open it in a PDF viewer to check it") from None
    text = "\n\n".join(t for t in texts if t)
    if not text:
        raise AttachmentError(f"{name} has no text layer (a scanned PDF?); its pages are images, which the "
                              "model cannot read: attach a PDF with text, or the text itself")
    return text, len(texts)


def read_attachment(path: str | os.PathLike[str]) -> Attachment:
    """Read the file at ``path`` for a message.

    Raises:
        AttachmentError: not a file, too large, binary, not UTF-8, a PDF that cannot be read or
            has no text, or a file with no text at all (the message says which, and what to do).
    """
    p = Path(path)
    name = p.name or str(p)
    try:
        if not p.is_file():
            raise AttachmentError(f"{name} is not a file; attach files one by one (not a folder)")
        size = p.stat().st_size
        kind, language = _kind(p)
        limit = MAX_PDF_BYTES if kind == "pdf" else MAX_TEXT_BYTES
        if size > limit:
            raise AttachmentError(f"{name} is {size / 2**20:,.1f} MiB, more than the {limit / 2**20:,.0f} MiB a "
                                  f"message takes from one {'PDF' if kind == 'pdf' else 'text file'}; "
                                  "attach the part you need")
        pages = None
        if kind == "pdf":
            text, pages = _read_pdf(p, name)
        else:
            text = _decode(p.read_bytes(), name)
    except OSError as exc:
        raise AttachmentError(f"{name} could not be read ({exc.strerror or exc}); check that it exists and "
                              "that you may read it") from None
    if not text.strip():
        raise AttachmentError(f"{name} is empty: there is nothing in it to send")
    return Attachment(name=name, path=str(p), kind=kind, language=language, text=text, size_bytes=size, pages=pages)


def message_text(typed: str, files: Sequence[Attachment]) -> str:
    """The message as it is sent and stored: each file's :meth:`Attachment.block`, then what was typed."""
    parts = [f.block() for f in files]
    if typed.strip():
        parts.append(typed.strip())
    return "\n\n".join(parts)
