"""The Server panel's KV pool: a batching server's pages drawn against its limit (each running
request, shared pages stored once, kept, cached, free, room not allocated), one line of
figures, and how the server runs requests (with the reason when one at a time)."""
from __future__ import annotations

import threading

from PySide6.QtGui import QColor

from desktop.remote.pool_bar import COLORS, PoolBar, mode_text, pool_segments, pool_summary

PAGE = 737_280  # the default model's page in float32 (16 tokens)
STATS = {
    "parallel": 4,
    "pages": {"dtype": "float32", "page_tokens": 16, "bytes_per_page": PAGE, "used_bytes": 17 * PAGE,
              "allocated_bytes": 22 * PAGE, "limit_bytes": 40 * PAGE, "pages_used": 17, "pages_shared": 4,
              "pages_cached": 3, "pages_free": 2, "pages_total": 22},
    "sequences": [
        {"id": "chatcmpl-a", "client": "127.0.0.1", "kept": False, "tokens": 150, "pages": 10, "shared_pages": 4},
        {"id": "chatcmpl-b", "client": "127.0.0.1", "kept": False, "tokens": 90, "pages": 6, "shared_pages": 4},
        {"id": None, "client": None, "kept": True, "tokens": 70, "pages": 5, "shared_pages": 0},
    ],
}


def test_segments_and_summary_of_a_pool():
    got = [(s.kind, s.pages) for s in pool_segments(STATS)]
    assert got == [("request", 6), ("request", 2), ("shared", 4), ("kept", 5), ("cached", 3), ("free", 2),
                   ("unallocated", 18)]
    assert sum(n for k, n in got if k in ("request", "shared", "kept")) == STATS["pages"]["pages_used"]
    assert pool_segments(STATS)[0].label == "chatcmpl-a from 127.0.0.1: 6 pages, 150 tokens"
    assert pool_summary(STATS) == ("2 requests running, 1 kept: 17 pages in use (4 shared), 3 cached, 2 free of 22 "
                                   "allocated; limit 28 MiB (16 tokens, 720 KiB a page)")
    assert pool_segments({"last": []}) == [] and pool_summary({}) == ""


def test_how_the_server_runs_requests():
    assert mode_text(STATS, []) == "4 replies decode together over one page pool:"
    lines = ["attnchat: one request at a time: batching needs --overflow stop, not --overflow rolling",
             "attnchat: serving x.gguf on cpu at http://127.0.0.1:1/v1 (no API key); Ctrl-C stops"]
    assert mode_text({"last": []}, lines) == ("One request at a time, no page pool (batching needs --overflow stop, "
                                              "not --overflow rolling).")
    assert mode_text({"last": []}, []) == "One request at a time, no page pool."


def test_the_bar_draws_each_segment_in_proportion(qtbot):
    bar = PoolBar()
    qtbot.addWidget(bar)
    bar.resize(400, 20)
    bar.set_segments(pool_segments(STATS))
    rects = bar.rects()
    widths = [r.width() for _, r in rects]
    assert abs(widths[0] / widths[-1] - 6 / 18) < 1e-6 and abs(sum(widths) - 399) < 1e-6
    image = bar.grab().toImage()

    def color_at(i):
        r = rects[i][1]
        return image.pixelColor(int(r.center().x()), int(r.center().y()))

    assert color_at(0) == QColor(COLORS["request"][0]) and color_at(1) == QColor(COLORS["request"][1])
    assert color_at(2) == QColor(COLORS["shared"]) and color_at(3) == QColor(COLORS["kept"])
    filled = [QColor(c) for c in (*COLORS["request"], COLORS["shared"], COLORS["kept"], COLORS["cached"], COLORS["free"])]
    assert color_at(5) == QColor(COLORS["free"]) and color_at(6) not in filled  # room not allocated: no fill
    assert "chatcmpl-b from 127.0.0.1: 2 pages, 90 tokens" in bar.toolTip()


def test_the_panel_shows_the_pool_while_serving_and_the_reason_without(make_window):
    w = make_window()
    panel = w.server_panel
    panel.show_stats(STATS)
    assert not panel.pool_bar.isHidden() and panel.mode.text() == "4 replies decode together over one page pool:"
    assert panel.pool_text.text() == pool_summary(STATS) and len(panel.pool_bar.segments) == 7
    w.serve_toggle.server._lines = ["attnchat: one request at a time: batching takes no cache policy (--cache-policy h2o)"]
    panel.show_stats({"last": []})
    assert panel.pool_bar.isHidden() and panel.pool_text.isHidden()
    assert panel.mode.text() == "One request at a time, no page pool (batching takes no cache policy (--cache-policy h2o))."
    w.close()


def test_a_real_batching_engines_stats_add_up(tmp_path):
    """The server's own figures after a conversation's second turn (its first turn's pages
    shared with the kept first reply): the bar's held pages are the pool's pages in use, and
    the shared pages are one segment."""
    from attnchat.server.batching import BatchEngine
    from attnchat.server.engine import Done, Job
    from runtime import GenerationSettings, Message, SamplingParams, load_model
    from tests.runtime.tiny_models import WORDS, make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32", threads=1)
    engine = BatchEngine(model, settings=GenerationSettings(context_limit=128, overflow="stop"), parallel=4)
    try:
        def ask(messages):
            items, done = [], threading.Event()
            engine.submit(Job(system=None, messages=messages, sampling=SamplingParams(temperature=0), max_tokens=4,
                              emit=lambda item: (items.append(item), isinstance(item, Done) and done.set())))
            assert done.wait(60)
            return next(i for i in items if isinstance(i, Done))

        first = [Message("user", " ".join(WORDS[:40]))]  # more than two pages of prompt
        reply = ask(first)
        ask([*first, Message("assistant", reply.text), Message("user", WORDS[41])])  # the conversation resent
        stats = engine.stats()
        segments = pool_segments(stats)
        held = sum(s.pages for s in segments if s.kind in ("request", "shared", "kept"))
        assert held == stats["pages"]["pages_used"] > 0
        shared = [s.pages for s in segments if s.kind == "shared"]
        assert shared == [stats["pages"]["pages_shared"]] and shared[0] >= 2  # the first turn's pages, stored once
    finally:
        engine.close()
