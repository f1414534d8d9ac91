"""kill -9 mid-reply: the real window (headless, on the fake engine) in a child process chats in
two conversations, saving through desktop.chat.store; it is killed with SIGKILL while a reply
streams. The database must open afterwards, pass ``PRAGMA integrity_check`` and hold every
message saved before the kill (the user message of the reply in flight included)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from desktop.chat.store import Store
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, sys
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtCore import QTimer
    from desktop.app import application, build_window
    from desktop.settings.values import Settings
    from desktop.chat.store import Store
    from desktop.worker import Engine, EngineWorker
    from tests.desktop.fakes import FakeSession, fake_load

    SCRIPT = [["warm"]]
    STREAM_FROM = 5      # turns 1-4 finish; turn 5 streams until the kill

    class Session(FakeSession):
        def _generate(self):
            self.script = list(SCRIPT[0])
            self.delay = 0.01 if len(self.script) > 100 else 0.001
            return super()._generate()

    app = application(headless=True)
    store = Store(sys.argv[1])
    window = build_window(store, Settings(sys.argv[2]),
                          Engine(EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: Session(g))),
                          confirm=lambda q: True)
    window.show()
    turn = [0]

    def next_turn():
        turn[0] += 1
        i = turn[0]
        if i == 3:
            window.new_conversation()   # a second conversation
        SCRIPT[0] = ["tok "] * 100_000 if i >= STREAM_FROM else ["answer ", str(i), " 🇫🇷"]
        window.input.setPlainText(f"question {i} \\x00 👩‍👩‍👧")
        window.input.submit()

    def finished(result):
        print(f"SAVED {result['conv_id']} {turn[0]}", flush=True)
        QTimer.singleShot(0, next_turn)

    def streaming(text):
        if turn[0] >= STREAM_FROM:
            print(f"STREAMING {window.current_conversation} {turn[0]}", flush=True)

    window.reply_finished.connect(finished)
    window.engine.text_batch.connect(streaming)
    window.engine.model_loaded.connect(lambda info: QTimer.singleShot(0, next_turn))
    window.load_model("fake.gguf")
    app.exec()
""")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_kill_9_while_a_reply_streams_keeps_every_earlier_message(tmp_path):
    db, ini = tmp_path / "conversations.sqlite3", tmp_path / "settings.ini"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen",
           "ATTNCHAT_CACHE_DIR": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(db), str(ini)], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)   # a child that hangs must not hang the suite
    watchdog.start()
    saved, streaming = [], None
    try:
        for line in proc.stdout:
            if not line.startswith(("SAVED ", "STREAMING ")):
                continue   # anything else a library prints
            kind, conv, turn = line.split()
            if kind == "SAVED":
                saved.append((int(conv), int(turn)))
            elif kind == "STREAMING":
                streaming = (int(conv), int(turn))
                os.kill(proc.pid, signal.SIGKILL)   # mid-reply, mid-whatever it is doing
                break
        proc.wait(timeout=HANG_S)
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert streaming is not None and [t for _, t in saved] == [1, 2, 3, 4]

    store = Store(db)
    try:
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        convs = {c.id for c in store.conversations()}
        assert convs == {c for c, _ in saved} | {streaming[0]} and len(convs) == 2
        for conv in convs:
            expected = []
            for c, t in saved + [streaming]:
                if c == conv:
                    expected.append(("user", f"question {t} \x00 👩‍👩‍👧"))
                    if (c, t) != streaming:
                        expected.append(("assistant", f"answer {t} 🇫🇷"))
            stored = [(m.role, m.content) for m in store.messages(conv)]
            # Every saved message is there, in order; the reply in flight may be missing, never half-written.
            assert stored == expected, (conv, stored)
    finally:
        store.close()
