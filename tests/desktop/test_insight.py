"""The attention panel's Insight tab: the formula sandbox (the material's numbers, predict then
reveal), the √d_k simulation, and explain / knock out / induction test / cost through the real
worker thread on a tiny seeded model, each exported as PNG and .npz."""
from __future__ import annotations

import numpy as np
import pytest

from desktop.panels.attention.insight.views import (
    InsightTabs,
    parse_head_list,
    scores_table,
)
from desktop.panels.attention.panel import INSIGHT, PANEL_NAME
from desktop.panels.attention.sandbox import (
    SandboxView,
    formula_by_hand,
    scale_simulation,
)
from desktop.worker import EngineWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def r3(xs):
    return [round(x, 3) for x in xs]


def test_sandbox_reproduces_the_worked_example(qtbot):
    v = SandboxView()
    qtbot.addWidget(v)
    r = v.result
    assert r3(r["scores"]) == [0, 4, 2] and r3(r["scaled"]) == [0, 2.828, 1.414]
    assert r3(r["weights"]) == [0.045, 0.768, 0.187] and r3(r["output"]) == [0.232, 0.955]
    assert v.table.item(1, 5).text() == "0.768" and "(0.232, 0.955)" in v.output.text()
    v.scale.setChecked(False)
    assert r3(v.result["weights"]) == [0.016, 0.867, 0.117]
    v.scale.setChecked(True)
    v.q.setText("0,1")
    v.causal.setChecked(True)
    v.causal_at.setValue(1)
    assert r3(v.result["weights"]) == [0.67, 0.33, 0.0] and v.table.item(2, 5).text() == "masked"


def test_predict_then_reveal(qtbot):
    v = SandboxView()
    qtbot.addWidget(v)
    v.hide.setChecked(True)
    assert [v.table.item(j, 5).text() for j in range(3)] == ["?", "?", "?"] and "?" in v.output.text()
    v.guess.setCurrentIndex(2)  # "sat wins": wrong
    v.reveal.click()
    assert not v.hide.isChecked() and v.table.item(1, 5).text() == "0.768"
    assert "Not quite" in v.verdict.text() and "cat" in v.verdict.text()
    v.hide.setChecked(True)
    v.guess.setCurrentIndex(1)
    v.reveal.click()
    assert v.verdict.text().startswith("Right")


def test_sandbox_bad_input_says_what_is_wrong(qtbot):
    v = SandboxView()
    qtbot.addWidget(v)
    v.k.setText("0,1  2,x")
    assert v.result is None and "'2,x' is not a vector" in v.output.text() and v.table.rowCount() == 0
    assert v.data() == {}
    v.load_example()
    assert v.result is not None


def test_sandbox_agrees_with_the_runtime_formula():
    from runtime.insight.formula import formula_by_hand as runtime_formula

    rng = np.random.default_rng(0)
    q, K, V = rng.standard_normal(6), rng.standard_normal((5, 6)), rng.standard_normal((5, 3))
    for causal in (None, 2):
        a = formula_by_hand(q.tolist(), K.tolist(), V.tolist(), causal_at=causal)
        b = runtime_formula(q.tolist(), K.tolist(), V.tolist(), causal_at=causal).to_dict()
        for k in ("scores", "scaled", "weights", "output"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-15)


def test_scale_simulation_spread_grows_as_sqrt_d():
    for d, spread in ((2, 1.4), (64, 8.0), (512, 22.6)):
        assert scale_simulation(d)["spread"] == pytest.approx(spread, rel=0.08)
    s = scale_simulation(64)
    assert s["entropy_unscaled"] < 0.5 * s["entropy_scaled"] <= s["uniform_bits"]
    assert s["max_weight_unscaled"] > 2 * s["max_weight_scaled"]


def test_cost_numbers_and_heads_parsing():
    rows = scores_table([1_000, 100_000], 30, 9)
    assert rows[0]["prefill"] == 1_000_000 and rows[1]["prefill"] == 10_000_000_000
    assert rows[1]["decode"] == 100_000 and rows[0]["prefill_model"] == 270_000_000
    assert parse_head_list("17.3, L18.H6 17.3", 30, 9) == [(17, 3), (18, 6)]
    with pytest.raises(ValueError, match="outside"):
        parse_head_list("30.0", 30, 9)
    with pytest.raises(ValueError, match="layer.head"):
        parse_head_list("17", 30, 9)


def insight_after_a_reply(qtbot, make_window, model, text: str):
    """A window on ``model`` (the real worker thread) after one short greedy reply to ``text``,
    with View > Attention open on its Insight tab: ``(window, panel)``."""
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: model))
    w.generation_overrides = {"max_new_tokens": 6, "temperature": 0.0}
    with qtbot.waitSignal(w.reply_finished, timeout=20_000):
        w.submit(text)
    dock = w.panels[PANEL_NAME]
    dock.toggleViewAction().trigger()
    panel = dock.widget()
    panel.tabs.setCurrentIndex(INSIGHT)
    return w, panel


def test_insight_through_the_worker_and_export(qtbot, make_window, tiny, tmp_path):
    w, panel = insight_after_a_reply(qtbot, make_window, tiny, "the cat sat")
    qtbot.waitUntil(panel.isVisible, timeout=2000)
    ins, c = panel.insight, panel.insight.client
    tabs: InsightTabs = ins.tabs
    assert panel.tabs.indexOf(tabs) == INSIGHT  # the screenshots find the tab by its widget
    panel.select(1, 2)

    tabs.explain.steps.setValue(4)
    tabs.explain.perms.setValue(4)
    with qtbot.waitSignal(c.explain_ready, timeout=30_000) as got:
        tabs.explain.run.click()
    ex = got.args[0]
    n = len(ex["tokens"])
    assert ex["layer"] == 1 and ex["head"] == 2 and ex["attention"].shape == (n,) and n >= 5
    assert abs(float(ex["attention"].sum()) - 1) < 1e-5 and len(ex["permutation"]["tv"]) == 4
    qtbot.waitUntil(lambda: tabs.explain.table.rowCount() == n)
    assert "Kendall" in tabs.explain.summary.text() and tabs.explain.sentence.text()

    tabs.knockout.heads.setText("0.1 1.2")
    tabs.knockout.mode.setCurrentIndex(0)
    with qtbot.waitSignal(c.knockout_ready, timeout=20_000) as got:
        tabs.knockout.run.click()
    ko = got.args[0]
    assert ko["heads"] == [[0, 1], [1, 2]] and len(ko["before"]["top"]) == 5
    assert ko["before"]["prob"] != ko["after"]["prob"]
    with qtbot.waitSignal(c.induction_ready, timeout=60_000) as got:
        tabs.knockout.run_preset.click()
    assert len(got.args[0]["heads"]) == 4  # half of the tiny model's 8 heads
    qtbot.waitUntil(lambda: tabs.knockout.preset_table.rowCount() == 5)

    with qtbot.waitSignal(c.cost_ready, timeout=20_000) as got:
        tabs.cost.measure.click()
    assert got.args[0]["seconds"] > 0 and got.args[0]["n_layers"] == 2
    qtbot.waitUntil(lambda: "ms" in tabs.cost.timing_label.text())
    assert tabs.cost.context > 5 and tabs.scale.head_dim == 16

    for i, name in enumerate(("explain", "knockout", "sandbox", "scale", "cost")):
        tabs.setCurrentIndex(i)
        assert panel.view_name() == f"insight-{name}"
        panel.export_png(tmp_path / f"{name}.png")
        panel.export_npz(tmp_path / f"{name}.npz")
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert str(np.load(tmp_path / f"{name}.npz")["view"]) == f"insight-{name}"
    assert np.load(tmp_path / "explain.npz")["integrated_gradients"].shape == (n,)
    assert np.load(tmp_path / "knockout.npz")["induction_loss"].shape == (2,)
    assert np.load(tmp_path / "sandbox.npz")["weights"].shape == (3,)
