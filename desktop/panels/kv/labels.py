"""Where the KV chart's line labels go, so that none covers another or leaves the chart.

Under the rolling policy the cache is evicted each time it reaches the context limit, so
the "evicted N" markers sit on the "context limit" line: their labels were drawn over each
other, and the memory limit's label, centred on its line, could run past the chart's
edge. :func:`place` tries a few spots along each line, on either side of it, in the chart's
pixels, and takes the first that stays inside the chart and clear of the labels placed
before it (the memory limit, then the context limit, then the markers, newest first).
Markers closer than a label's thickness share one label (:func:`clusters`); a marker
label with no free spot is not drawn (the readout still names the last eviction).

:func:`place` and :func:`clusters` are pure geometry (numbers in, numbers out);
:func:`lay_out` applies them to the chart's pyqtgraph lines (``InfiniteLine``; an eviction
marker carries ``kv_event = (tokens before, after, kind)``). No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Box", "Label", "box", "clusters", "lay_out", "place"]

#: Spots along a vertical line (0: the chart's bottom, 1: its top) in the order tried.
CONTEXT_SPOTS = (0.62, 0.85, 0.4, 0.2)
EVENT_SPOTS = (0.25, 0.8, 0.5, 0.1, 0.95)
#: Spots along a horizontal line (0: the chart's left, 1: its right), text starting or ending there.
MEMORY_SPOTS = ((0.04, (0.0, 1.0)), (0.96, (1.0, 1.0)), (0.04, (0.0, 0.0)), (0.96, (1.0, 0.0)))
#: Pixels kept between labels and from the chart's edges: pyqtgraph measures a label's spot
#: along its line's bounding box, a few pixels longer than the visible line.
PAD = 4.0


@dataclass(frozen=True)
class Box:
    """A rectangle in the chart's pixels (y down)."""

    left: float
    top: float
    right: float
    bottom: float

    def overlaps(self, other: "Box", pad: float = 0.0) -> bool:
        return (self.left - pad < other.right and other.left < self.right + pad
                and self.top - pad < other.bottom and other.top < self.bottom + pad)

    def inside(self, width: float, height: float, pad: float = 0.0) -> bool:
        return self.left >= pad and self.top >= pad and self.right <= width - pad and self.bottom <= height - pad


@dataclass(frozen=True)
class Label:
    """A line's label: ``at`` is the line's x (vertical line) or y (horizontal) in pixels;
    ``w``, ``h`` the text's size before rotation (vertical lines' labels read upwards)."""

    key: object
    vertical: bool
    at: float
    w: float
    h: float
    spots: tuple = ()   # ((position, (anchor x, anchor y)), ...) to try, in order


def box(label: Label, position: float, anchor: tuple[float, float], width: float, height: float) -> Box:
    """The pixels ``label`` covers at ``position`` along its line with text ``anchor`` (as
    pyqtgraph's InfLineLabel places it: the anchor point of the text on the line's point)."""
    ax, ay = anchor
    if label.vertical:   # rotated a quarter turn: the text's x runs up, its y runs right
        x, y = label.at, height * (1 - position)
        return Box(x - ay * label.h, y - (1 - ax) * label.w, x + (1 - ay) * label.h, y + ax * label.w)
    x, y = width * position, label.at
    return Box(x - ax * label.w, y - ay * label.h, x + (1 - ax) * label.w, y + (1 - ay) * label.h)


def place(labels: list[Label], width: float, height: float, *, required: tuple = (), pad: float = PAD) -> dict:
    """``{key: (position, anchor) or None}``: the first spot of each label (in order) ``pad``
    pixels inside the chart and ``pad`` clear of those placed before it; None: none is free. A
    label in ``required`` gets its first spot inside the chart when none is clear (it is never left out)."""
    placed: list[Box] = []
    out: dict = {}
    for label in labels:
        inside = [(p, a) for p, a in label.spots if box(label, p, a, width, height).inside(width, height, pad)]
        free = [(p, a) for p, a in inside if not any(box(label, p, a, width, height).overlaps(b, pad) for b in placed)]
        choice = free[0] if free else None
        if choice is None and label.key in required:   # never left out: the least bad spot
            loose = [(p, a) for p, a in label.spots if box(label, p, a, width, height).inside(width, height, -1.0)]
            clear = [(p, a) for p, a in loose if not any(box(label, p, a, width, height).overlaps(b) for b in placed)]
            choice = (clear or loose or inside or list(label.spots) or [None])[0]
        out[label.key] = choice
        if choice is not None:
            placed.append(box(label, *choice, width, height))
    return out


def clusters(xs: list[float], gap: float) -> list[list[int]]:
    """Indices of ``xs`` grouped where neighbours (in x order) are closer than ``gap``; each
    group in the order given (the newest marker last)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and xs[i] - xs[groups[-1][-1]] < gap:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def lay_out(vb, memory_line, context_line, markers: list) -> None:
    """Place the labels of ``memory_line`` (horizontal), ``context_line`` and the eviction or
    truncation ``markers`` (vertical) in the view box ``vb``'s pixels: markers closer than a
    label share one (``"evicted 564 (3×)"``, on the newest); a marker label with no room is hidden."""
    width, height = vb.width(), vb.height()
    (x0, x1), (y0, y1) = vb.viewRange()
    if width <= 0 or height <= 0 or x1 <= x0 or y1 <= y0:
        return

    def px(x: float) -> float:
        return (x - x0) / (x1 - x0) * width

    def size(line):   # the text's size before rotation
        return line.label.textItem.boundingRect()

    def sides(spots) -> tuple:   # left of a vertical line, then right of it
        return tuple((p, (0.5, 1.0)) for p in spots) + tuple((p, (0.5, 0.0)) for p in spots)

    todo: list[tuple[Label, object]] = []
    for line, vertical, spots in ((memory_line, False, MEMORY_SPOTS), (context_line, True, sides(CONTEXT_SPOTS))):
        at = px(line.value()) if vertical else (1 - (line.value() - y0) / (y1 - y0)) * height
        shown = line.isVisible() and 0 <= at <= (width if vertical else height)
        line.label.setVisible(shown)
        if shown:
            r = size(line)
            todo.append((Label(line, vertical, at, r.width(), r.height(), spots), line))
    xs = [px(m.value()) for m in markers]
    thickness = max((size(m).height() for m in markers), default=0)
    for group in reversed(clusters(xs, thickness + 2)):   # the newest markers' labels first
        newest = markers[group[-1]]
        for i in group[:-1]:
            markers[i].label.setVisible(False)
        kind = newest.kv_event[2]
        total = sum(markers[i].kv_event[0] - markers[i].kv_event[1] for i in group)
        newest.label.setFormat(f"{kind} {total:,}" + (f" ({len(group)}×)" if len(group) > 1 else ""))
        if not 0 <= xs[group[-1]] <= width:
            newest.label.setVisible(False)
            continue
        r = size(newest)
        todo.append((Label(newest, True, xs[group[-1]], r.width(), r.height(), sides(EVENT_SPOTS)), newest))
    spots = place([label for label, _ in todo], width, height, required=(context_line, memory_line))
    for label, line in todo:
        spot = spots[label.key]
        line.label.setVisible(spot is not None)
        if spot is not None:
            position, anchor = spot
            line.label.anchors = [anchor, anchor]
            line.label.setPosition(position)
