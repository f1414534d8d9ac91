"""The settings dialog's memory planner for a sliding-window, multi-query model (Gemma 3
270M's shape: 18 layers, 15 of them sliding over 512 tokens, 4 query heads, 1 KV head of
256) and the attention-variant comparison under it, at the context the user picks."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import runtime
from desktop.worker import EngineWorker
from tests.desktop.fakes import fake_session_factory
from tests.desktop.test_settings_dialog import big_window, dialog, set_value  # noqa: F401  (fixture)

MIB = 2**20
GEMMA_WINDOWS = tuple(None if i % 6 == 5 else 512 for i in range(18))


def gemma_load(source, device):
    cfg = SimpleNamespace(max_position_embeddings=32768, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
                          windows=GEMMA_WINDOWS)
    return SimpleNamespace(name="gemma-3-270m", path=Path(source or "gemma.gguf"), device="cpu", dtype="float32",
                           config=cfg, load_seconds=0.01, weights_bytes=1_072_000_000, has_chat_template=False)


@pytest.fixture
def gemma_window(make_window):
    return make_window(worker=EngineWorker(load_fn=gemma_load, session_fn=fake_session_factory()))


def _table(d) -> list[list[str]]:
    t = d.planner.variants.table
    return [[t.item(r, c).text() for c in range(t.columnCount())] for r in range(t.rowCount())]


def test_sliding_layers_are_planned_and_the_variants_compared(gemma_window, monkeypatch, qtbot, tmp_path):
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2 * 2**30)
    d = dialog(gemma_window)
    set_value(d, "generation/cache_dtype", "float32")
    set_value(d, "generation/context", 32768)
    rows = d.planner.rows
    assert rows["model"].text() == "gemma-3-270m: 18 layers (15 slide over 512 tokens) × 1 KV heads × 256 dims"
    # 3 full layers x 2,048 B x 32,768 tokens (192 MiB) + 15 sliding layers x 2,048 B x 512 tokens (15 MiB).
    assert rows["at_context"].text() == "207.0 MiB" and d.planner.last_plan.kv_bytes == 207 * MIB
    # Free 2 GiB, weights loaded: the 15 sliding layers stop at 15 MiB, the rest grows by 6,144 B per token.
    assert rows["in_free"].text() == f"{(2 * 2**30 - 15 * MIB) // 6144:,} tokens (the model stops at 32,768)"
    header = d.planner.variants.table.horizontalHeaderItem(4).text()
    assert header == "At 32,768 tokens" and "float32 cache, at 32,768 tokens" in d.planner.variants.caption.text()
    assert _table(d) == [
        ["multi-head", "4", "—", "147,456 B", "4,608.0 MiB", "22.26×"],
        ["multi-query", "1", "—", "36,864 B", "1,152.0 MiB", "5.57×"],
        ["sliding-window", "1", "512 × 18 layers", "36,864 B", "18.0 MiB", "0.09×"],
        ["this model", "1", "512 × 15 of 18", "36,864 B", "207.0 MiB", "1.00×"],
    ]
    assert d.planner.variants.table.item(3, 0).font().bold() and not d.planner.variants.table.item(0, 0).font().bold()
    d.show()
    d.tabs.widget(0).ensureWidgetVisible(d.planner.variants.table)  # the tab scrolls: the plan needs the height
    qtbot.wait(50)
    assert d.grab().save(str(tmp_path / "planner.png"))
    # A shorter context moves only the "at" column: under the window, every variant holds every token.
    set_value(d, "generation/context", 400)
    assert [r[4] for r in _table(d)] == ["56.2 MiB", "14.1 MiB", "14.1 MiB", "14.1 MiB"]


def test_a_grouped_query_model_is_its_own_row(big_window):
    """32 query heads sharing 8 KV heads, no window: grouped-query is this model; the
    sliding-window row uses Mistral 7B's 4,096-token window for comparison."""
    d = dialog(big_window)
    set_value(d, "generation/cache_dtype", "bfloat16")
    assert [r[:3] for r in _table(d)] == [["multi-head", "32", "—"], ["grouped-query (this model)", "8", "—"],
                                          ["multi-query", "1", "—"], ["sliding-window", "8", "4,096 × 32 layers"]]
    assert d.planner.variants.table.item(1, 0).font().bold()
    assert [r[3] for r in _table(d)] == ["524,288 B", "131,072 B", "16,384 B", "131,072 B"]
    assert [r[5] for r in _table(d)] == ["4.00×", "1.00×", "0.12×", "0.50×"]  # 8,192 tokens: the window halves it


def test_a_gguf_run_from_its_blocks_is_planned_at_its_bytes(make_window, monkeypatch):
    """A quantized GGUF loaded from its own blocks names its quantization as its dtype:
    the planner takes its weights as loaded and its cache in the dtype the load gave it
    (float16, the blocks' default on the CPU; bfloat16 where this machine timed it faster)."""
    cache = ["float16"]

    def load(source, device):
        m = gemma_load(source, device)
        m.dtype, m.compute_dtype, m.weights_bytes, m.cache_dtype = "Q4_K_M", "float32", 253_000_000, cache[0]
        return m

    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2 * 2**30)
    d = dialog(make_window(worker=EngineWorker(load_fn=load, session_fn=fake_session_factory())))
    set_value(d, "generation/context", 4096)
    rows = d.planner.rows
    assert rows["weights"].text() == f"{253_000_000 / MIB:.1f} MiB (Q4_K_M)"
    assert d.planner.last_plan.cache_dtype == "float16" and d.planner.last_plan.kv_bytes_per_token == 18_432
    set_value(d, "model/weight_dtype", "float16")  # widened: its bytes are not the blocks'
    assert rows["weights"].text().startswith("unknown")
    cache[0] = "bfloat16"
    d = dialog(make_window(worker=EngineWorker(load_fn=load, session_fn=fake_session_factory())))
    set_value(d, "generation/context", 4096)
    assert d.planner.last_plan.cache_dtype == "bfloat16" and d.planner.last_plan.kv_bytes_per_token == 18_432


def test_the_model_rows_name_shows_whole_in_the_dialog(big_window, qtbot):
    """Sized before the dialog's layout narrowed its column, "grouped-query (this model)" was cut
    to "grouped-query (this …" in an 1100 x 720 window's dialog."""
    d = dialog(big_window)
    d.resize(640, 620)
    d.show()
    t = d.planner.variants.table
    qtbot.waitUntil(lambda: t.isVisible() and t.columnWidth(0) > 0, timeout=2000)
    for width in (640, 560):   # and after the dialog is made narrower
        d.resize(width, 620)
        qtbot.wait(50)
        assert t.item(1, 0).text() == "grouped-query (this model)"
        # As tall as Qt's delegate says the wrapped text needs at the column's present width.
        assert t.rowHeight(1) >= t.sizeHintForRow(1) > t.sizeHintForRow(0), (width, t.columnWidth(0))
        assert t.height() >= t.horizontalHeader().height() + sum(t.rowHeight(r) for r in range(t.rowCount()))
    d.close()
