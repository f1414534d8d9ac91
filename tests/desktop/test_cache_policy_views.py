"""The cache policy in the app: Settings > cache policy and budget (with the measured figures
beside each choice), the KV panel's kept line against the full one, and the live attention
view greying the tokens a layer evicted (a real tiny model under a policy for the last)."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import runtime
from desktop.panels.attention.probe import AttentionProbe
from desktop.panels.attention.views import LiveView
from desktop.panels.kv.panel import KVPanel
from desktop.settings.dialog import SettingsDialog
from desktop.settings.labels import cache_policy_hint, cache_policy_label
from desktop.settings.values import Settings
from desktop.worker.generation_settings import generation_settings

MIB = 2**20
SMOL = {"name": "smol", "device": "cpu", "dtype": "float32", "context_limit": 8192,
        "n_layers": 30, "n_kv_heads": 3, "head_dim": 64}
BPT = 46_080
DEVICES = [("auto", "Automatic"), ("cpu", "CPU")]
#: Where the tests save widget grabs to look at (set ATTNCHAT_GRABS=DIR); tmp_path otherwise.
GRABS = os.environ.get("ATTNCHAT_GRABS")


def _grab(widget, tmp_path, name: str) -> Path:
    from PySide6.QtWidgets import QApplication

    QApplication.processEvents()  # the layout takes the labels' new heights first
    path = Path(GRABS or tmp_path) / name
    assert widget.grab().save(str(path))
    return path


def test_settings_offer_each_policy_with_its_figures_and_a_budget(qtbot, tmp_path):
    settings = Settings(tmp_path / "s.ini")
    d = SettingsDialog(settings, dict(SMOL), devices=DEVICES)
    qtbot.addWidget(d)
    combo = d.fields["generation/cache_policy"].editor
    assert [combo.itemData(i) for i in range(combo.count())] == list(runtime.CACHE_POLICIES)
    assert [combo.itemText(i) for i in range(combo.count())] == [cache_policy_label(p) for p in runtime.CACHE_POLICIES]
    budget, unit = d.fields["generation/cache_budget"], d.fields["generation/cache_budget_unit"]
    assert not budget.isEnabled() and not unit.isEnabled()  # no policy: no budget
    combo.setCurrentIndex(combo.findData("h2o"))
    assert budget.isEnabled() and unit.isEnabled() and d.ok_button.isEnabled()
    assert d.fields["generation/cache_policy"].hint.text() == cache_policy_hint("h2o")
    assert combo.sizeHint().width() < 400 < combo.view().minimumWidth()  # the list shows the figures whole
    over = d.fields["generation/overflow"].editor
    over.setCurrentIndex(over.findData("rolling"))
    assert "rolling already evicts" in d.fields["generation/cache_policy"].error.text() and not d.ok_button.isEnabled()
    over.setCurrentIndex(over.findData("stop"))
    budget.editor.setValue(16)
    assert "at least 64 tokens" in d.fields["generation/cache_budget"].error.text()
    budget.editor.setValue(6)
    unit.editor.setCurrentIndex(unit.editor.findData("MiB"))
    assert d.ok_button.isEnabled()  # 6 MiB hold 136 tokens of this model
    assert d.apply()
    gen = generation_settings(settings.generation_values())
    assert (gen.cache_policy, gen.cache_budget, gen.cache_budget_bytes, gen.overflow) == ("h2o", None, 6 * MIB, "stop")
    settings.set("generation/cache_budget_unit", "tokens")
    settings.set("generation/cache_budget", 512.0)
    gen = generation_settings(settings.generation_values())
    assert (gen.cache_budget, gen.cache_budget_bytes) == (512, None)
    _grab(d, tmp_path, "settings-cache-policy.png")


def test_the_default_cache_policy_reads_whole_in_the_closed_box(qtbot, tmp_path):
    """It read "none: keep every token (the context limit ends the conversation) —" (cut; and with
    truncate-middle or rolling the context limit does not end the conversation)."""
    d = SettingsDialog(Settings(tmp_path / "s.ini"), dict(SMOL), devices=DEVICES)
    qtbot.addWidget(d)
    d.show()
    qtbot.waitExposed(d)
    combo = d.fields["generation/cache_policy"].editor
    text = combo.currentText()
    assert text == cache_policy_label("none") and text.startswith("none: keep every token")
    room = combo.width() - combo.iconSize().width() - 40   # the frame and the arrow
    assert combo.fontMetrics().horizontalAdvance(text) <= room, (text, room)


def test_policy_labels_carry_the_measured_figures():
    measured = {"model": "m", "machine": "x", "full": (9, 10),
                "policies": {"tova": {0.25: (2, 10, 0.4), 0.5: (5, 10, 0.12)}}}
    assert cache_policy_label("tova", measured) == ("TOVA: what the newest token looks at \u2014 "
                                                    "50%: 5/10 needles, NLL +0.12 \u00b7 25%: 2/10 needles, NLL +0.40")
    assert cache_policy_label("none", measured).endswith("\u2014 9/10 needles")
    assert cache_policy_label("h2o", measured) == "H2O: the most attended tokens + the newest"
    assert cache_policy_hint("tova", measured).startswith(
        "Measured: 50%: 5/10 needles, NLL +0.12 \u00b7 25%: 2/10 needles, NLL +0.40. m, measured when attnchat was "
        "built on x (`attnchat cache-eval` measures this computer")   # "m on x" read as this computer
    assert not cache_policy_hint("h2o", measured).startswith("Measured")


def _policy_stats(positions, *, held_max=256, request=1):
    held = min(positions, held_max)
    return {"conv_id": 1, "request": request, "context_limit": 8192, "dropped_tokens": 0,
            "kv_cache": {"dtype": "float32", "bytes_per_token": BPT, "tokens": held, "used_bytes": held * BPT,
                         "allocated_bytes": 512 * BPT, "limit_bytes": None, "positions": positions,
                         "evicted_tokens": positions - held, "full_bytes": positions * BPT}}


def test_kv_panel_draws_the_kept_line_against_the_full_one(qtbot, tmp_path):
    settings = Settings(tmp_path / "s.ini")
    settings.set("generation/cache_policy", "h2o")
    settings.set("generation/overflow", "stop")
    p = KVPanel(settings)
    qtbot.addWidget(p)
    p.resize(420, 520)
    p.show()
    p.on_model(dict(SMOL))
    for n in range(100, 1001, 50):
        p.on_stats(_policy_stats(n))
    p.redraw()
    s = p.series
    assert s.tokens[-1] == 1000 and (s.held, s.evicted) == (256, 744) and s.evicting
    xs, ys = p.full_curve.getData()
    assert list(xs) == [float(t) for t in s.tokens] and ys[-1] == pytest.approx(1000 * BPT / MIB)
    used = p.used_curve.getData()[1]
    assert used[-1] == pytest.approx(256 * BPT / MIB) and used[0] == pytest.approx(100 * BPT / MIB)
    names = [label.text for _, label in p.legend.items]
    assert "full cache" in names and "kept" in names and "used" not in names
    text = p.readout.text()
    assert "keeps <b>256</b> of 1,000 tokens (744 evicted)" in text and "26\u00a0% of the full cache" in text
    # "allocated 22.50 MiB" for a 256-token budget, said without a why, read as the policy passing its budget.
    assert "Allocated stays at 22.50 MiB (512 tokens' room): the cache evicts after each forward pass" in text
    assert "<b>1,000</b> / 8,192 tokens" in text  # the context is the conversation's length
    assert not s.events  # evictions every few tokens are no markers
    _grab(p, tmp_path, "kv-panel-kept-vs-full.png")
    # Another conversation without a policy: no full line, the legend says "used" again.
    p.on_conversation({})
    p.on_stats({"conv_id": 2, "request": 5, "context_limit": 8192, "kv_cache": {
        "dtype": "float32", "bytes_per_token": BPT, "tokens": 90, "used_bytes": 90 * BPT, "allocated_bytes": 256 * BPT,
        "limit_bytes": None, "positions": 90, "evicted_tokens": 0, "full_bytes": 90 * BPT}})
    p.redraw()
    names = [label.text for _, label in p.legend.items]
    assert "full cache" not in names and "used" in names and len(p.full_curve.getData()[0] or []) == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    return runtime.load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024),
                              device="cpu", dtype="float32")


def test_live_view_greys_what_each_layer_evicted(qtbot, tmp_path, tiny):
    from tests.runtime.tiny_models import WORDS

    st = runtime.GenerationSettings(max_new_tokens=6, context_limit=1024, overflow="stop", cache_policy="h2o",
                                    cache_budget=64, prefill_chunk=32)
    session = runtime.ChatSession(tiny, settings=st)
    worker = SimpleNamespace(model=tiny, live_attention=None)
    probe = AttentionProbe(worker)
    probe.set_active(True)
    frames = []
    probe.live.connect(frames.append)
    for _ in probe.wrap(1, session, session.send(" ".join(WORDS * 2))):
        pass
    frame = frames[-1]
    assert frame["final"] and frame["cache_policy"] == "h2o"
    T = len(frame["tokens"])
    kept = frame["kept"]
    assert kept.shape == (2, T) and T == session.cache.length
    for layer in range(2):
        held = session.cache.held_mask(layer)[0].float().mean(0).numpy()
        np.testing.assert_array_equal(kept[layer], held)
        # What the layer no longer holds got no attention from the newest token.
        assert frame["weights"][layer][:, kept[layer] == 0].max() == 0
    gone = int((kept[1] == 0).sum())
    assert gone > T // 2

    view = LiveView()
    qtbot.addWidget(view)
    view.resize(480, 640)
    view.show()
    view.set_frame(frame)
    view.set_selection(1, "mean")
    assert f"Layer 1 evicted {gone:,} of {T:,} tokens (h2o), greyed" in view.caption.text()
    np.testing.assert_array_equal(view.text.kept, kept[1])
    view._hover(int(np.flatnonzero(kept[1] == 0)[0]))
    assert "evicted by this layer" in view.readout.text()
    assert "kept" in view.data()
    _grab(view, tmp_path, "live-view-evicted.png")
