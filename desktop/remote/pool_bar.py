"""The Server panel's KV pool: the served model's pages drawn against the pool's memory limit.

A batching server (``attnchat serve``, several replies decoding together) keeps every request's
keys and values in one pool of fixed-size pages; its ``GET /v1/attnchat/stats`` gives the
pool's counts (``pages``) and each running or kept sequence's pages (``sequences``).
:func:`pool_segments` turns them into the bar's segments, left to right: each running request's
own pages, the pages shared by several sequences (a common system prompt, a conversation
resent), the pages of finished replies kept for their next turn, pages cached for a prefix,
free pages, and the room not yet allocated up to the limit. :class:`PoolBar` paints them;
:func:`pool_summary` says them in one line. A server running one request at a time has no
pool: the panel says so with the reason its startup line gave.

Must not import torch, runtime or attnchat (the server is a child process).
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

__all__ = ["COLORS", "PoolBar", "Segment", "mode_text", "pool_segments", "pool_summary"]

#: Segment kind -> fill colour (requests take the first hue in turn: each its own shade).
COLORS = {
    "request": ("#2e7d32", "#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4527a0"),
    "shared": "#c62828",
    "kept": "#78909c",
    "cached": "#b0bec5",
    "free": "#eceff1",
    "unallocated": None,  # an outline only: memory not taken yet
}


@dataclass(frozen=True)
class Segment:
    """``pages`` of one ``kind`` (request, shared, kept, cached, free, unallocated); ``label`` for its tooltip."""

    kind: str
    pages: int
    label: str


def pool_segments(stats: dict) -> list[Segment]:
    """The bar's segments from a ``/v1/attnchat/stats`` answer (empty without a page pool).

    Pages held by one sequence count for it; pages held by several are one ``shared`` segment
    (counted once, as the pool stores them once). The limit in pages is ``limit_bytes`` over
    the bytes of an allocated page (a model with sliding-window layers has pages of two sizes:
    their mean).
    """
    pages = stats.get("pages")
    if not isinstance(pages, dict) or not pages.get("bytes_per_page"):
        return []
    out: list[Segment] = []
    kept = 0
    for seq in stats.get("sequences") or []:
        own = max(0, int(seq.get("pages") or 0) - int(seq.get("shared_pages") or 0))
        if seq.get("kept"):
            kept += own
        elif own:
            who = seq.get("client") or "a client"
            out.append(Segment("request", own, f"{seq.get('id') or 'request'} from {who}: {own:,} pages, "
                                               f"{int(seq.get('tokens') or 0):,} tokens"))
    for kind, n, words in (("shared", pages.get("pages_shared"), "shared by several requests (stored once)"),
                           ("kept", kept, "finished replies kept for their next turn"),
                           ("cached", pages.get("pages_cached"), "cached for a prefix a next request may reuse"),
                           ("free", pages.get("pages_free"), "allocated and free")):
        if n:
            out.append(Segment(kind, int(n), f"{int(n):,} pages {words}"))
    total = int(pages.get("pages_total") or 0)
    limit = pages.get("limit_bytes")
    if limit:
        per_page = (pages["allocated_bytes"] / total) if total and pages.get("allocated_bytes") else pages["bytes_per_page"]
        room = int(limit // per_page) - total
        if room > 0:
            out.append(Segment("unallocated", room, f"{room:,} pages of room not allocated yet"))
    return out


def pool_summary(stats: dict) -> str:
    """One line: ``"1 request running, 3 kept: 52 pages in use (8 shared), 10 cached, 20 free of 82
    allocated; limit 360 MiB (16 tokens, 720 KiB a page)"``; "" without a page pool."""
    pages = stats.get("pages")
    if not isinstance(pages, dict) or not pages.get("bytes_per_page"):
        return ""
    seqs = stats.get("sequences") or []
    running = sum(1 for s in seqs if not s.get("kept"))
    kept = len(seqs) - running
    limit = pages.get("limit_bytes")
    return (f"{running} request{'s' * (running != 1)} running, {kept} kept: {int(pages.get('pages_used') or 0):,} pages "
            f"in use ({int(pages.get('pages_shared') or 0):,} shared), {int(pages.get('pages_cached') or 0):,} cached, "
            f"{int(pages.get('pages_free') or 0):,} free of {int(pages.get('pages_total') or 0):,} allocated; "
            + (f"limit {limit / 2**20:,.0f} MiB" if limit else "no limit")
            + f" ({int(pages.get('page_tokens') or 0)} tokens, {pages['bytes_per_page'] / 1024:,.0f} KiB a page)")


def mode_text(stats: dict, lines: list[str]) -> str:
    """How the server runs requests: ``"4 replies decode together"``, or one at a time and why
    (its startup line, ``lines``: the server's output)."""
    if stats.get("parallel"):
        return f"{int(stats['parallel'])} replies decode together over one page pool:"
    why = next((line.removeprefix("attnchat: one request at a time: ") for line in reversed(lines)
                if line.startswith("attnchat: one request at a time: ")), "")
    return "One request at a time, no page pool" + (f" ({why})." if why else ".")


class PoolBar(QWidget):
    """The pool drawn as one bar (segments in proportion to their pages; hover for each one's words)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("serverPoolBar")
        self.segments: list[Segment] = []
        self.setMinimumHeight(18)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)

    def sizeHint(self) -> QSize:
        return QSize(240, 22)

    def set_segments(self, segments: list[Segment]) -> None:
        self.segments = list(segments)
        self.setToolTip("\n".join(s.label for s in self.segments))
        self.update()

    def rects(self) -> list[tuple[Segment, QRectF]]:
        """Each segment's rectangle in the widget (left to right, widths in proportion to pages)."""
        total = sum(s.pages for s in self.segments)
        if not total:
            return []
        inner = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        out, x = [], inner.left()
        for s in self.segments:
            w = inner.width() * s.pages / total
            out.append((s, QRectF(x, inner.top(), w, inner.height())))
            x += w
        return out

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        hue = 0
        for s, r in self.rects():
            color = COLORS[s.kind]
            if s.kind == "request":
                color = color[hue % len(color)]
                hue += 1
            if color is None:
                p.setPen(QPen(self.palette().mid().color(), 1, Qt.PenStyle.DashLine))
                p.setBrush(Qt.BrushStyle.NoBrush)
            else:
                p.setPen(Qt.PenStyle.NoPen)
                p.setBrush(QColor(color))
            p.drawRect(r)
        p.setPen(QPen(self.palette().mid().color(), 1))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5))
        p.end()
