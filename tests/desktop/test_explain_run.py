"""Insight > Explain while it runs: what it will take said as it starts, a progress bar that
moves, Cancel that stops it between passes, and the result after a run to the end (a tiny
seeded model on the real worker thread; each pass slowed so that a run lasts a while)."""
from __future__ import annotations

import time

import pytest

from runtime.insight import gradients as ex_mod
from tests.desktop.test_insight import insight_after_a_reply


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def test_explain_says_what_it_takes_shows_progress_and_cancels(qtbot, make_window, tiny, monkeypatch, tmp_path):
    real = ex_mod._logprob_grads
    monkeypatch.setattr(ex_mod, "_logprob_grads", lambda *a: (time.sleep(0.4), real(*a))[1])   # a slow machine
    monkeypatch.setattr(ex_mod, "IG_BUDGET_BYTES", 1)   # one step per batch: progress after each
    w, panel = insight_after_a_reply(qtbot, make_window, tiny, "the cat sat on the mat")
    view, client = panel.insight.tabs.explain, panel.insight.client
    view.steps.setValue(12)
    view.perms.setValue(4)
    started, progress = [], []
    client.explain_started.connect(lambda rid, plan: started.append(plan))
    client.explain_progress.connect(lambda rid, done, total, work: progress.append((done, total)))

    # What it will take is said before it starts (it said nothing: one status line for minutes).
    qtbot.waitUntil(lambda: view.estimate.isVisible() and view.estimate.text().startswith("Explain of "),
                    timeout=20_000)
    assert " context tokens: about " in view.estimate.text() and "(at most " in view.estimate.text()
    assert "of memory at most" in view.estimate.text() and view.run.isEnabled()
    assert "one gradient pass timed now" in view.estimate.text()   # before any run: how the time was found
    # The time said first counts the gradient passes' own cost (0.4 s each here; the plan was
    # timed by a no-gradient forward, a few ms on this model: "about 0 s" for a run of 6 s).
    assert view._plan["seconds"] >= 13 * 0.4 * 1.5 / 2.5
    view.grab().save(str(tmp_path / "explain-before.png"))

    # It showed no progress and had no way to stop it.
    view.run.click()
    qtbot.waitUntil(lambda: bool(started), timeout=20_000)
    plan = started[0]
    assert plan["passes"] == 1 + 12 + 4 and plan["tokens"] > 5 and plan["peak_bytes"] > 0
    assert 0 < plan["seconds"] <= plan["most_seconds"]
    assert view.estimate.isVisible() and view.estimate.text().startswith(f"Explaining {plan['tokens']} context tokens: about ")
    assert "of memory at most" in view.estimate.text()
    assert view.progress.isVisible() and view.cancel.isVisible() and not view.run.isEnabled()
    qtbot.waitUntil(lambda: len(progress) >= 2, timeout=20_000)
    assert view.progress.maximum() == plan["passes"] and 0 < view.progress.value() < plan["passes"]
    qtbot.waitUntil(lambda: "left." in view.estimate.text() or "Almost done." in view.estimate.text(), timeout=5000)
    view.grab().save(str(tmp_path / "explain-running.png"))
    with qtbot.waitSignal(client.failed, timeout=20_000) as failed:
        view.cancel.click()
    assert failed.args[1] == "Explain cancelled."
    assert progress[-1][0] < plan["passes"]   # stopped before the end
    assert not view.progress.isVisible() and not view.cancel.isVisible() and view.run.isEnabled()
    assert panel.status.text() == "Explain cancelled." and view.result is None

    # Again (3 steps, the fewest), to the end: the result, and the progress gone.
    progress.clear()
    view.steps.setValue(2)
    assert view.steps.value() == 3
    with qtbot.waitSignal(client.explain_ready, timeout=60_000):
        view.run.click()
    assert progress[-1] == (1 + 3 + 4, 1 + 3 + 4)
    qtbot.waitUntil(lambda: view.result is not None, timeout=5000)
    assert not view.progress.isVisible() and view.run.isEnabled() and view.result["ig_steps"] == 3
    qtbot.waitUntil(lambda: view.estimate.isVisible() and "measured by the last Explain" in view.estimate.text(),
                    timeout=20_000)   # said again for the next run, from the run's own speed
    # The table fits the panel: its columns were wider than a 280 px dock (a scroll bar, "ntext tok").
    w.resize(1100, 720)
    qtbot.wait(100)
    assert view.table.horizontalHeader().length() <= view.table.viewport().width() + 1
    # The result's texts left two rows of the table at 720 px: it keeps at least six, the view scrolls.
    assert view.table.viewport().height() >= 6 * view.table.verticalHeader().defaultSectionSize()
    view.grab().save(str(tmp_path / "explain-result.png"))


def test_the_views_defaults_are_the_runtimes(qtbot):
    import runtime
    from desktop.panels.attention.insight.explain import ExplainView

    v = ExplainView()
    qtbot.addWidget(v)
    assert (v.steps.value(), v.window.value()) == (runtime.IG_STEPS, runtime.IG_POSITIONS)


def test_a_new_chat_drops_the_last_conversations_estimate(qtbot, make_window, tiny):
    """In a new chat the line still said "Explain of 238 context tokens: about 6 min" (the last
    conversation's) until its first reply ended."""
    w, panel = insight_after_a_reply(qtbot, make_window, tiny, "the cat sat on the mat")
    view = panel.insight.tabs.explain
    qtbot.waitUntil(lambda: view.estimate.isVisible() and view.estimate.text().startswith("Explain of "),
                    timeout=20_000)
    first = w.current_conversation
    w.new_conversation()
    assert w.current_conversation != first
    qtbot.waitUntil(lambda: not view.estimate.isVisible(), timeout=5000)
    assert view.estimate.text() == "" and view._plan == {}
    w.chats.open(first)   # back: its estimate again
    qtbot.waitUntil(lambda: view.estimate.isVisible() and view.estimate.text().startswith("Explain of "),
                    timeout=20_000)


def test_cancel_keeps_the_views_scroll_position(qtbot):
    """Clicking Cancel made the Explain view jump: the disabled button's focus went to the next
    widget down, which the scroll area then scrolled into view."""
    from PySide6.QtCore import Qt

    from desktop.panels.attention.insight.explain import ExplainView

    view = ExplainView()
    qtbot.addWidget(view)
    view.resize(300, 220)   # shorter than its content: it scrolls
    view.show()
    qtbot.waitExposed(view)
    view.set_running({"tokens": 300, "passes": 130, "seconds": 370.0, "peak_bytes": 1 << 30})
    qtbot.wait(50)
    bar = view.scroll.verticalScrollBar()
    assert bar.maximum() > 0
    view.scroll.ensureWidgetVisible(view.cancel)
    qtbot.wait(20)
    before = bar.value()
    qtbot.mouseClick(view.cancel, Qt.MouseButton.LeftButton)   # the controller disables it: "Cancelling Explain…"
    view.cancelling()
    qtbot.wait(50)
    assert not view.cancel.isEnabled() and bar.value() == before
    view.set_idle()   # "Explain cancelled."
    qtbot.wait(50)
    assert bar.value() == min(before, bar.maximum())


def test_the_rate_is_timed_again_for_a_context_far_from_the_one_timed(monkeypatch):
    """An 82-token chat was said to take longer than a 486-token one: the per-token rate timed on
    one context was used for every other, a pass's fixed cost spread over its tokens."""
    from types import SimpleNamespace

    import runtime
    from desktop.panels.attention.insight.probe import InsightProbe

    timed = []
    monkeypatch.setattr(runtime, "explain_rate", lambda model, window, n: timed.append(n) or 0.01 + 1.0 / n)
    monkeypatch.setattr(runtime, "explain_cost", lambda model, n, **kw: {
        "passes": 130, "token_passes": 100 * n, "typical_token_passes": 60 * n, "peak_bytes": 1 << 30})
    probe = InsightProbe(attention_probe=None)
    model = SimpleNamespace(path="/models/smol.gguf")
    plan = lambda n: probe._plan(model, list(range(n + 1)), 97, 32, 64)   # noqa: E731 - n context tokens
    first = plan(486)
    assert timed == [486] and first["basis"] == "this machine: one gradient pass timed now"
    assert first["seconds"] == pytest.approx(60 * 486 * (0.01 + 1 / 486))
    plan(300)
    assert timed == [486]   # near the timed context: the same rate
    short = plan(82)
    assert timed == [486, 82] and short["seconds"] == pytest.approx(60 * 82 * (0.01 + 1 / 82))
    plan(150)
    assert timed == [486, 82]


def _explain_running(qtbot, make_window, tiny, monkeypatch, steps: int, perms: int):
    """A window whose Explain has started on a slow machine (0.3 s a gradient pass, one step
    per batch, so it can stop after each): the window, the view, its client, and the progress
    ``(done, total)`` seen so far (it grows)."""
    real = ex_mod._logprob_grads
    monkeypatch.setattr(ex_mod, "_logprob_grads", lambda *a: (time.sleep(0.3), real(*a))[1])
    monkeypatch.setattr(ex_mod, "IG_BUDGET_BYTES", 1)
    w, panel = insight_after_a_reply(qtbot, make_window, tiny, "the cat sat on the mat")
    view, client = panel.insight.tabs.explain, panel.insight.client
    view.steps.setValue(steps)
    view.perms.setValue(perms)
    progress = []
    client.explain_progress.connect(lambda rid, done, total, work: progress.append((done, total)))
    qtbot.waitUntil(lambda: view.run.isEnabled(), timeout=20_000)
    view.run.click()
    qtbot.waitUntil(lambda: len(progress) >= 1, timeout=20_000)
    return w, view, client, progress


def test_quit_during_explain_stops_it_at_its_next_pass(qtbot, make_window, tiny, monkeypatch):
    """Quit waited for a running Explain to end (minutes on a real chat): the window's close
    ends the engine's thread, which runs Explain, and only a reply was told to stop."""
    w, view, client, progress = _explain_running(qtbot, make_window, tiny, monkeypatch, 24, 4)
    failed = []
    client.failed.connect(lambda rid, message: failed.append(message))
    w.close()
    qtbot.wait(50)   # what the thread sent before it ended
    assert progress[-1][0] < progress[-1][1] // 2   # it stopped: 1 + 24 + 4 passes of 0.3 s were left to run
    assert not w.engine._thread and failed == ["Explain cancelled."]


def test_loading_another_model_stops_a_running_explain(qtbot, make_window, tiny, monkeypatch):
    """The load waited behind Explain on the engine's thread ("Loading the model…" for minutes),
    for a result the new model then cleared."""
    w, view, client, progress = _explain_running(qtbot, make_window, tiny, monkeypatch, 24, 4)
    failed = []
    client.failed.connect(lambda rid, message: failed.append(message))
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):   # 1 + 24 + 4 passes of 0.3 s were left
        w.load_model("another.gguf")
    assert failed == ["Explain cancelled."]
    assert progress[-1][0] < progress[-1][1] // 2 and view.result is None and view.run.isEnabled()


def test_a_message_sent_during_explain_says_it_waits_for_it(qtbot, make_window, tiny, monkeypatch):
    """The reply sat at "Reading the prompt…" for the rest of the Explain (both run on the
    engine's thread), with nothing saying why."""
    from desktop.main_window.replies import waiting_note

    w, view, client, progress = _explain_running(qtbot, make_window, tiny, monkeypatch, 3, 2)
    assert w.engine.holding == "Explain"
    with qtbot.waitSignal(w.reply_finished, timeout=30_000):
        w.submit("and the dog?")
        assert w.notice.isVisible() and w.notice.text() == waiting_note("Explain")
        assert w.notice.property("kind") == "note"
        qtbot.waitUntil(lambda: w.engine.holding == "", timeout=20_000)   # Explain ended: the reply runs
        qtbot.waitUntil(lambda: not w.notice.isVisible(), timeout=20_000)
    assert view.result is not None   # Explain ran to its end first
    with qtbot.waitSignal(w.reply_finished, timeout=20_000):
        w.submit("once more")   # nothing holds the thread now: no note
        assert not w.notice.isVisible()
