"""The KV chart's line labels under rolling overflow: none drawn over another or past the
chart's edge (the context limit's and the eviction markers' labels were drawn over each
other at the limit, and the memory limit's could run past the edge)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from desktop.panels.kv.labels import Label, box, clusters, place
from tests.desktop.test_kv_panel import SMOL, stats

MIB = 2**20


def rolling(kv, *, evictions: int, limit=856, limit_mib=10.0):
    """A rolling conversation: the cache grows to the context limit and is cut by 212 each
    time, ``evictions`` times (the markers all sit at the limit)."""
    t, req = 100, 1
    for _ in range(60):
        t += 24
        if t > limit:
            t -= 212
            evictions -= 1
            if evictions < 0:
                break
        kv.on_stats(stats(t, request=req, limit=limit, limit_bytes=int(limit_mib * MIB)))
    kv.redraw()


def shown_labels(kv) -> list:
    lines = [kv.context_line, kv.memory_line, *kv.event_items]
    return [(line.label.toPlainText(), line.label.sceneBoundingRect())
            for line in lines if line.isVisible() and line.label.isVisible()]


@pytest.mark.parametrize("width", [240, 286, 420])
@pytest.mark.parametrize("zoom", [True, False])
def test_no_label_covers_another_or_leaves_the_chart(qtbot, make_window, width, zoom, tmp_path):
    w = make_window()
    w.resize(1100, 720)
    qtbot.waitUntil(lambda: w.width() == 1100, timeout=2000)
    w.settings.set("generation/overflow", "rolling")
    w.settings.set("generation/cache_limit_mib", 10.0)
    dock = w.panels["kvCachePanel"]
    w.resizeDocks([dock], [width], Qt.Orientation.Horizontal)
    kv = dock.widget()
    kv.on_model(dict(SMOL))
    kv.zoom.setChecked(zoom)
    rolling(kv, evictions=3)
    chart = lambda: kv.plot.getPlotItem().vb.sceneBoundingRect().adjusted(-1, -1, 1, 1)   # noqa: E731

    def laid_out() -> bool:
        rects = [r for _, r in shown_labels(kv)]
        return all(chart().contains(r) for r in rects) and not any(
            a.intersects(b) for i, a in enumerate(rects) for b in rects[i + 1:])

    # Drawn: pyqtgraph moves the labels when the view's transform settles (later on a busy machine).
    qtbot.waitUntil(laid_out, timeout=5000)
    labels = shown_labels(kv)
    texts = [t for t, _ in labels]
    assert "context limit 856" in texts and "memory limit 10.0 MiB" in texts
    events = kv.series.events
    assert len(events) == 3 and len({b for b, _, _ in events}) > 1   # three markers a few tokens apart
    total = sum(b - a for b, a, _ in events)
    assert [t for t in texts if t.startswith("evicted")] == [f"evicted {total:,} (3×)"]   # one label for them
    for text, rect in labels:
        assert chart().contains(rect), (text, rect, chart())
    for i, (a, ra) in enumerate(labels):
        for b, rb in labels[i + 1:]:
            assert not ra.intersects(rb), (a, b, ra, rb)
    dock.grab().save(str(tmp_path / f"kv-{width}-{zoom}.png"))


def test_the_layout_tries_spots_along_and_beside_each_line():
    context = Label("context", True, at=200, w=110, h=22, spots=((0.62, (0.5, 1.0)), (0.62, (0.5, 0.0))))
    marker = Label("marker", True, at=195, w=80, h=22, spots=((0.62, (0.5, 1.0)), (0.25, (0.5, 1.0))))
    got = place([context, marker], 230, 340)
    assert got == {"context": (0.62, (0.5, 1.0)), "marker": (0.25, (0.5, 1.0))}
    # Left of the line, centred at 62 % of the height (y down).
    b = box(context, 0.62, (0.5, 1.0), 230, 340)
    assert (b.left, b.right) == (178, 200) and b.top == pytest.approx(340 * 0.38 - 55) and b.bottom == pytest.approx(340 * 0.38 + 55)
    # No free spot: a marker is left out, a required label takes its first spot inside.
    crowded = Label("late", True, at=199, w=300, h=22, spots=((0.5, (0.5, 1.0)),))
    assert place([context, crowded], 230, 340)["late"] is None
    # Required and nowhere inside (300 px of text in 200): drawn anyway, at its first spot.
    assert place([crowded], 230, 200, required=("late",))["late"] == (0.5, (0.5, 1.0))
    assert clusters([10.0, 200.0, 205.0, 12.0], 8) == [[0, 3], [1, 2]]
