"""Regenerate samples by default and keeps every earlier reply of the turn as a branch
(``‹ 2/3 ›``), stored in SQLite (the window on a scripted fake engine)."""
from __future__ import annotations

from PySide6.QtCore import Qt

from desktop.worker import EngineWorker
from tests.desktop.fakes import FakeSession, fake_load


class _Counting:
    """Sessions whose n-th reply (over all sessions) is "Reply n."; they record their settings."""

    def __init__(self):
        self.n = 0
        self.settings = []

    def __call__(self, model, system, settings):
        outer = self

        class Session(FakeSession):
            def _generate(self):
                outer.n += 1
                outer.settings.append(self.settings)
                self.script = [f"Reply {outer.n}."]
                return super()._generate()
        return Session(settings)


def _window(make_window, sessions):
    """A window on the fake engine whose sessions are ``sessions``."""
    return make_window(worker=EngineWorker(load_fn=fake_load, session_fn=sessions))


def _send(qtbot, w, text: str) -> None:
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit(text)


def _regenerate(qtbot, w):
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.regenerate()


def test_regenerate_samples_and_keeps_the_earlier_replies_as_branches(qtbot, make_window):
    sessions = _Counting()
    w = _window(make_window, sessions)
    _send(qtbot, w, "Tell me a joke")
    _regenerate(qtbot, w)
    _regenerate(qtbot, w)
    conv = w.current_conversation
    # The defaults sample (they were greedy: Regenerate repeated the same reply), each reply with its own seed.
    params = [s.sampling for s in sessions.settings]
    assert all(p.temperature == 0.7 and p.top_p == 0.95 and p.seed is not None for p in params)
    assert len({p.seed for p in params}) == 3
    reply = w.store.messages(conv)[1]
    assert (reply.content, reply.version, reply.versions) == ("Reply 3.", 3, 3)
    assert w.messages.rowCount() == 2 and w.messages.message(1)["versions"] == 3
    names = [b.name for b in w.chat.buttons(1)]
    assert names[:3] == ["prev", "branch", "next"]
    index = w.messages.index(1)
    assert w.chat.delegate().label("branch", index) == "3/3"
    assert f"seed {params[-1].seed}" in w.chat.header(1).note
    # ‹ goes back to the earlier replies; the conversation goes on from the one shown.
    prev = next(b for b in w.chat.buttons(1) if b.name == "prev")
    qtbot.mouseClick(w.chat.viewport(), Qt.MouseButton.LeftButton, pos=prev.rect.center())
    qtbot.mouseClick(w.chat.viewport(), Qt.MouseButton.LeftButton, pos=prev.rect.center())
    assert w.messages.message(1)["content"] == "Reply 1." and w.chat.delegate().label("branch", index) == "1/3"
    assert not w.chat.delegate().enabled("prev", index) and w.chat.delegate().enabled("next", index)
    assert w.store.messages(conv)[1].content == "Reply 1."
    # The KV panel says why no cache of it exists now (it said "an earlier run, or other settings").
    readout = w.panels["kvCachePanel"].widget().readout.text()
    assert "<i>Its last reply's cache</i> (it holds another version of this reply): " in readout
    _send(qtbot, w, "Another")
    kv = w.panels["kvCachePanel"].widget()
    qtbot.waitUntil(lambda: "No KV cache" not in kv.readout.text(), timeout=3000)   # the new reply's cache
    assert conv not in w.chats.other_branch
    assert [m.content for m in FakeSession.instances[-1].messages][:2] == ["Tell me a joke", "Reply 1."]
    assert "Reply 1." in w.store.export_markdown(conv) and "Reply 3." not in w.store.export_markdown(conv)


def test_after_a_restart_a_branch_switch_still_says_an_earlier_run(qtbot, make_window):
    """No cache exists after a restart: switching branches must not say the cache holds the other one."""
    sessions = _Counting()
    w = _window(make_window, sessions)
    _send(qtbot, w, "Hello")
    _regenerate(qtbot, w)
    w.close()
    again = _window(make_window, sessions)
    again.show_branch(1, -1)
    assert again.messages.message(1)["version"] == 1
    readout = again.panels["kvCachePanel"].widget().readout.text()
    assert "(an earlier run, or other settings)" in readout and "another version" not in readout


def test_branches_survive_a_restart(qtbot, make_window):
    sessions = _Counting()
    w = _window(make_window, sessions)
    _send(qtbot, w, "Hello")
    _regenerate(qtbot, w)
    w.show_branch(1, -1)
    conv = w.current_conversation
    w.close()
    again = _window(make_window, _Counting())
    assert again.current_conversation == conv
    m = again.messages.message(1)
    assert (m["content"], m["version"], m["versions"]) == ("Reply 1.", 1, 2)
    again.show_branch(1, 1)
    assert again.messages.message(1)["content"] == "Reply 2."


def test_a_reply_seed_can_be_used_again(qtbot, make_window):
    sessions = _Counting()
    w = _window(make_window, sessions)
    _send(qtbot, w, "Hello")
    seed = sessions.settings[-1].sampling.seed
    stats = w.store.messages(w.current_conversation)[1].stats
    assert stats["settings"]["seed"] == -1 and stats["settings"]["reply_seed"] == seed   # the setting, and the draw
    w.chat.seed_requested.emit(seed)
    assert w.settings.get("generation/seed") == seed
    _regenerate(qtbot, w)
    assert sessions.settings[-1].sampling.seed == seed


def test_sampling_presets_in_the_settings_dialog(qtbot, tmp_path):
    from desktop.settings.dialog import SettingsDialog
    from desktop.settings.values import Settings

    d = SettingsDialog(Settings(tmp_path / "s.ini"), None, devices=[("auto", "auto")])
    qtbot.addWidget(d)
    assert d.preset.currentData() == "balanced"   # the defaults
    d.preset.setCurrentIndex(d.preset.findData("greedy"))
    d.preset.activated.emit(d.preset.currentIndex())
    v = d.values()
    assert (v["generation/temperature"], v["generation/top_k"], v["generation/top_p"]) == (0.0, 0, 1.0)
    d.fields["generation/temperature"].editor.setValue(0.5)
    assert d.preset.currentData() == "custom"
    d.preset.setCurrentIndex(d.preset.findData("creative"))
    d.preset.activated.emit(d.preset.currentIndex())
    assert d.values()["generation/temperature"] == 1.0 and d.preset.currentData() == "creative"
    assert d.apply() and d.settings.get("generation/temperature") == 1.0
