"""The KV-cache panel: the chart follows a streaming reply (its plotted data, not pixels),
the lines and limits, truncation and eviction markers, and the readout."""
from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from PySide6.QtCore import Qt

from desktop.panels.kv.panel import REDRAW_MS, KVPanel, policy_next
from desktop.worker import EngineWorker
from runtime import Finish, Message, StatsUpdate, TextPiece, TurnStats
from tests.desktop.fakes import FakeSession

MIB = 2**20
#: The default model's shape: 30 layers x 3 KV heads x 64 dims (46,080 bytes per token in float32).
SMOL = {"name": "smol", "device": "cpu", "dtype": "float32", "context_limit": 8192,
        "n_layers": 30, "n_kv_heads": 3, "head_dim": 64}
BPT = 46_080


def smol_load(source, device):
    cfg = SimpleNamespace(max_position_embeddings=8192, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)
    return SimpleNamespace(name="smol", path=Path("smol.gguf"), device="cpu", dtype="float32", config=cfg, load_seconds=0.01)


class StatsSession(FakeSession):
    """The scripted fake, plus the runtime's StatsUpdate every 4 tokens with a float32 cache
    that grows in 256-token chunks (as runtime.ChatSession sends them)."""

    PROMPT = 200

    def _generate(self):
        self._cancel.clear()
        shown, tokens = [], self.PROMPT
        for i, piece in enumerate(self.script):
            time.sleep(self.delay)
            tokens += 1
            shown.append(piece)
            yield TextPiece(piece)
            if i % 4 == 3:
                yield StatsUpdate(self._stats(tokens, len(shown)))
        text = "".join(shown)
        self.messages.append(Message("assistant", text))
        yield Finish("stop", text, self._stats(tokens, len(shown)))

    def _stats(self, tokens, n):
        kv = {"dtype": "float32", "bytes_per_token": BPT, "tokens": tokens, "used_bytes": tokens * BPT,
              "allocated_bytes": -(-tokens // 256) * 256 * BPT, "limit_bytes": 64 * MIB}
        return TurnStats(prompt_tokens=self.PROMPT, completion_tokens=n, context_limit=1456, kv_cache=kv)


def stats(tokens, *, request=1, conv=1, dropped=0, limit=4096, limit_bytes=None):
    return {"conv_id": conv, "request": request, "context_limit": limit, "dropped_tokens": dropped,
            "kv_cache": {"dtype": "float32", "bytes_per_token": BPT, "tokens": tokens, "used_bytes": tokens * BPT,
                         "allocated_bytes": -(-tokens // 256) * 256 * BPT, "limit_bytes": limit_bytes}}


@pytest.fixture
def panel(qtbot):
    p = KVPanel()
    qtbot.addWidget(p)
    p.on_model(dict(SMOL))
    return p


def test_the_chart_follows_a_streaming_reply(qtbot, make_window):
    script = [f" w{i}" for i in range(48)]
    worker = EngineWorker(load_fn=smol_load, session_fn=lambda m, system, gen: StatsSession(gen, script, 0.02))
    w = make_window(worker=worker)
    kv = w.panels["kvCachePanel"].widget()
    assert REDRAW_MS <= 250   # at least four redraws a second while data comes
    w.input.setPlainText("grow the cache")
    redraws = kv.redraws
    qtbot.keyClick(w.input, Qt.Key.Key_Return)
    # Mid-reply: the plotted used line already holds several points and moves on.
    qtbot.waitUntil(lambda: kv.used_curve.getData()[0] is not None and len(kv.used_curve.getData()[0]) >= 3, timeout=3000)
    assert w.replying
    seen = list(kv.used_curve.getData()[0])
    qtbot.waitUntil(lambda: len(kv.used_curve.getData()[0]) > len(seen), timeout=3000)
    assert w.replying and kv.redraws - redraws >= 2
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        pass
    qtbot.waitUntil(lambda: kv.used_curve.getData()[0][-1] == 248, timeout=1000)
    x, y = kv.used_curve.getData()
    assert list(x) == [204 + 4 * i for i in range(12)] and x[-1] == 200 + 48
    assert all(math.isclose(yi, xi * BPT / MIB) for xi, yi in zip(x, y))
    ax, ay = kv.allocated_curve.getData()
    assert list(ax) == list(x) and ay[-1] == 256 * BPT / MIB
    assert kv.context_line.value() == 1456 and kv.memory_line.value() == 64
    assert "248</b> / 1,456 tokens" in kv.readout.text()


def test_lines_limits_and_readout(panel):
    # The theoretical lines: bytes per token of each dtype times tokens, across the context.
    # int8: a byte per number and a float32 scale per 64-number vector: 46,080 / 4 + 720 x 4.
    assert panel.theoretical() == {"float32": BPT, "16-bit": BPT // 2, "int8": 12_240}
    panel.on_stats(stats(1234, limit=4096, limit_bytes=200 * MIB))
    panel.zoom.setChecked(False)   # the whole context
    x, y = panel.theory["float32"].getData()
    assert list(x) == [0, 4096] and math.isclose(y[-1], 4096 * BPT / MIB)
    assert math.isclose(panel.theory["16-bit"].getData()[1][-1], 4096 * BPT / 2 / MIB)
    assert math.isclose(panel.theory["int8"].getData()[1][-1], 4096 * 12_240 / MIB)
    assert panel.context_line.value() == 4096 and panel.memory_line.value() == 200
    assert panel.context_line.isVisible() and panel.memory_line.isVisible()
    text = panel.readout.text()
    for part in ("1,234</b> / 4,096 tokens (30%)", f"({1234 * BPT:,} bytes)", "46,080 bytes per token (float32)",
                 "of a 200.0 MiB limit", "In 2,862 tokens the context is full: truncate-middle drops the oldest turns"):
        assert part in text, (part, text)
    panel.zoom.setChecked(True)
    # Zoomed (the default): twice the tokens used, at least 128, at most the context.
    assert panel.zoom.isChecked() and panel.theory["float32"].getData()[0][-1] == 2468
    panel.on_stats(stats(100, limit=4096, limit_bytes=200 * MIB))
    panel.redraw()
    assert panel.theory["float32"].getData()[0][-1] == 2468   # the span follows the longest the chat got


def test_zoom_spans_a_short_chat_and_an_edit_cuts_the_line_to_the_cache(panel):
    for t in range(45, 84, 4):
        panel.on_stats(stats(t, request=1))
    panel.redraw()
    # Zoomed: twice the 81 tokens used (not 0..1,024 for a 45..90-token chat).
    assert panel.theory["float32"].getData()[0][-1] == 162
    assert panel.plot.getPlotItem().viewRange()[0][1] == pytest.approx(162 * 1.02)
    panel.zoom.setChecked(False)
    assert panel.plot.getPlotItem().viewRange()[0][1] == pytest.approx(4096 * 1.02)
    panel.zoom.setChecked(True)
    # An edit of the first message: the cache kept the 30 tokens before it, then read 15 more.
    panel.on_stats(dict(stats(45, request=2), reused_tokens=30))
    panel.redraw()
    xs, _, _ = panel.plotted()
    assert xs == [45.0] and panel.series.events == []   # nothing left of the 81-token line
    assert panel.theory["float32"].getData()[0][-1] == 128   # the span follows: at least 128
    panel.on_stats(dict(stats(60, request=3), reused_tokens=45))   # the next turn keeps it all
    assert panel.series.tokens == [45, 60]


def test_an_eviction_shows_on_the_chart(panel):
    settings = SimpleNamespace(get=lambda key: {"generation/overflow": "rolling", "generation/sink_tokens": 4,
                                                "generation/context": 0, "generation/cache_limit_mib": 0.0}[key])
    panel.settings = settings
    for t in (4000, 4092, 4096):
        panel.on_stats(stats(t))
    panel.on_stats(stats(3073))   # rolling: a quarter of the window evicted, at once
    panel.redraw()
    assert panel.series.events == [(4096, 3073, "evicted")]
    assert [line.value() for line in panel.event_items] == [4096]
    x, _, _ = panel.plotted()
    assert math.isnan(x[3]) and x[4] == 3073    # the line breaks instead of running backwards
    assert "Last evicted: 1,023 tokens at 4,096 (now 3,073)" in panel.readout.text()
    assert "rolling evicts the oldest 1,023 tokens after the first 4" in panel.readout.text()


def test_truncation_at_a_new_turn_is_marked_and_a_regenerate_crop_is_not(panel):
    panel.on_stats(stats(3000, request=1))
    panel.on_stats(stats(2500, request=2))             # regenerate: cropped to the shared prefix
    assert panel.series.events == []
    panel.on_stats(stats(1800, request=3, dropped=900))  # the next turn did not fit: oldest turns dropped
    assert panel.series.events == [(2500, 1800, "truncated")]
    # The truncated cache is read again past the prefix it kept: the old line goes, the mark stays.
    panel.on_stats(stats(2000, request=4))
    panel.on_stats(dict(stats(1700, request=5, dropped=600), reused_tokens=40))
    assert panel.series.tokens == [1700] and panel.series.events[-1] == (2000, 1700, "truncated")
    panel.on_stats(stats(10, conv=2, request=6))        # another conversation: a fresh chart
    assert panel.series.tokens == [10] and panel.series.events == []


def test_before_the_first_reply_and_for_a_remote_engine(panel):
    panel.redraw()
    assert "No reply yet" in panel.readout.text() and "46,080 bytes per token in float32" in panel.readout.text()
    assert "23,040 in 16-bit, 12,240 in int8 (with its scales)." in panel.readout.text()   # 2 x 30 x 3 x (64 + 4)
    assert panel.context_line.value() == 8192
    panel.on_model({"name": "m", "device": "server x", "dtype": "", "context_limit": 4096, "remote": True})
    panel.on_stats({"conv_id": 1, "request": 1, "remote": True, "kv_cache": {}})
    panel.redraw()
    assert panel.plot.isHidden() and "The server keeps this model's KV cache" in panel.readout.text()


def test_a_remote_attnchat_servers_cache_figures_are_shown(panel):
    """Beside a server's reply the panel said "No reply yet." and that the server does not expose its
    cache, though attnchat's server sends its cache's figures with every answer."""
    panel.on_model({"name": "m", "device": "server x", "dtype": "", "context_limit": 8192, "remote": True})
    kv = {"dtype": "float32", "tokens": 44, "used_bytes": 44 * BPT, "allocated_bytes": 256 * BPT}
    panel.on_stats({"conv_id": 1, "request": 1, "remote": True, "completion_tokens": 7, "ttft_s": 2.59,
                    "server_usage": {"prompt_tokens": 37, "completion_tokens": 7, "total_tokens": 44},
                    "server_stats": {"finish_reason": "stop", "kv_cache": kv}})
    panel.flush()   # what a reply's end does: drawn at once
    text = panel.readout.text()
    assert "No reply yet" not in text and "Server usage: 37 prompt tokens, 7 reply tokens." in text
    assert "Its KV cache after the reply: 44 tokens, 1.93 MiB used (11.25 MiB allocated), float32." in text
    panel.on_stats({"conv_id": 1, "request": 2, "remote": True, "completion_tokens": 3,
                    "server_usage": {"prompt_tokens": 9, "completion_tokens": 3}})   # another server: no cache figures
    panel.flush()
    assert "Its KV cache" not in panel.readout.text() and "9 prompt tokens" in panel.readout.text()


def test_policy_sentences():
    assert "the reply stops" in policy_next("stop", 100, 100, 4) and policy_next("stop", 100, 100, 4).startswith("Now")
    assert "drops the oldest turns" in policy_next("truncate-middle", 10, 100, 4)
    assert "evicts the oldest 24 tokens after the first 4" in policy_next("rolling", 10, 100, 4)


def test_a_sliding_window_model_bends_the_lines_and_the_used_curve(qtbot):
    """Gemma 3 270M's shape (15 of 18 layers keep 512 tokens): the theoretical lines bend at
    512 tokens and the used curve, fed the real KV cache's own stats, bends with them."""
    from runtime.cache.kv_cache import KVCache

    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    info = {"name": "gemma", "device": "cpu", "dtype": "float32", "context_limit": 32768,
            "n_layers": 18, "n_kv_heads": 1, "head_dim": 256, "layer_windows": windows}
    panel = KVPanel()
    qtbot.addWidget(panel)
    panel.on_model(info)
    xs, ys = panel.theory_curve(36_864, 2000)  # float32: 2 x 18 x 1 x 256 x 4 bytes per token
    assert xs == [0, 512, 2000]
    assert ys[1] * MIB == 36_864 * 512 and (ys[2] - ys[1]) * MIB == 6_144 * (2000 - 512)
    cache = KVCache(18, 1, 256, 4096, windows=windows)
    while cache.length < 2048:
        cache.reserve(64)
        cache.advance(64)
        panel.on_stats({"conv_id": 1, "context_limit": 4096, "kv_cache": cache.stats()})
    panel.redraw()
    s = panel.series
    slope = lambda a, b: (s.used[s.tokens.index(b)] - s.used[s.tokens.index(a)]) / (b - a)  # noqa: E731
    assert slope(64, 512) == 36_864 and slope(1024, 2048) == 6_144  # bytes per token before and after the bend
    assert "6,144 past the 512-token window (15 of 18 layers slide)" in panel.readout.text()


def test_a_prompt_read_after_an_edit_starts_from_the_prefix_the_cache_kept(panel):
    for t in (100, 200, 300):
        panel.on_stats(stats(t, request=1))
    # The edit's prompt: the cache was cropped to 50 tokens, then read in chunks.
    for done in (0, 100):
        panel.on_stats(dict(stats(50 + done, request=2), prefill={"done": done, "total": 200}))
    assert panel.series.tokens == [] and panel.series.pending[0][0] == 50   # no 100..300 line beside it
    panel.on_stats(dict(stats(260, request=2), reused_tokens=50))
    assert panel.series.tokens == [260] and panel.series.events == []


def test_the_readout_says_the_finished_replys_tokens_as_the_status_bar_does(qtbot, make_window):
    """The panel said "205 / 8,192 tokens" beside the status bar's "Context 209 / 8,192" (the
    --screenshot set's main window): its redraw timer had not yet drawn the reply's last figures."""
    script = [f" w{i}" for i in range(50)]   # the last StatsUpdate at 248 tokens, the Finish at 250
    worker = EngineWorker(load_fn=smol_load, session_fn=lambda m, system, gen: StatsSession(gen, script, 0.002))
    w = make_window(worker=worker)
    kv = w.panels["kvCachePanel"].widget()
    kv._timer.setInterval(60_000)   # no redraw by the timer inside this test: only the reply's end draws
    seen = []
    w.reply_finished.connect(lambda *_: seen.append((kv.readout.text(), w.status.context_label.text())))
    w.input.setPlainText("grow the cache")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    readout, status = seen[0]
    assert status == "Context 250 / 1,456"
    assert "250</b> / 1,456 tokens" in readout
