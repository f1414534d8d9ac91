"""The interactive terminal chat: streamed replies, Ctrl-C stops the reply (not the program), /reset, /exit."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow


class _Reader:
    """Collects a pipe's output on a thread so the test can wait for text."""

    def __init__(self, stream):
        self.text = ""
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for chunk in iter(lambda: stream.read(1), ""):
            self._q.put(chunk)

    def wait_for(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.text += self._q.get(timeout=0.1)
            except queue.Empty:
                pass
            if predicate(self.text):
                return self.text
        raise AssertionError(f"timed out; output so far:\n{self.text}")


def test_ctrl_c_stops_the_reply_then_reset_and_exit(default_model_file):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnchat", "chat", "--model", str(default_model_file), "--max-new-tokens", "400"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    out = _Reader(proc.stdout)
    try:
        out.wait_for(lambda t: "> " in t, 120)
        start = len(out.text)
        proc.stdin.write("Write a very long story about a cat who sails around the world.\n")
        proc.stdin.flush()
        out.wait_for(lambda t: len(t) - start > 40, 60)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        text = out.wait_for(lambda t: "(stopped)" in t and "tok/s" in t.split("(stopped)")[1], 30)
        assert proc.poll() is None, "Ctrl-C must stop the reply, not the program"
        proc.stdin.write("/reset\n")
        proc.stdin.flush()
        out.wait_for(lambda t: "(conversation cleared)" in t, 10)
        proc.stdin.write("What is the capital of France?\n")
        proc.stdin.flush()
        out.wait_for(lambda t: "Paris" in t.split("(conversation cleared)")[1], 60)
        proc.stdin.write("/exit\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_regenerate_and_the_same_conversation_again_give_the_same_greedy_text(default_model, monkeypatch, capsys):
    """In the terminal chat: a reply, /regenerate (its prompt from the cache with the logits its
    prefill left), then /reset and the same message read from scratch: the same greedy text
    three times, and /regenerate is a command, not a message."""
    from attnchat.cli.chat import _interactive
    from runtime.generate.events import GenerationSettings
    from runtime.generate.session import ChatSession

    lines = iter(["Name two colours of the French flag.", "/regenerate", "/reset",
                  "Name two colours of the French flag.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": (print(prompt, end=""), next(lines))[1])
    session = ChatSession(default_model, settings=GenerationSettings(max_new_tokens=16))
    assert _interactive(session) == 0
    out = capsys.readouterr().out
    replies = [part.split("\n[")[0] for part in out.split("> ")[1:] if "tokens," in part]
    assert len(replies) == 3 and replies[0].strip(), out
    assert replies[0] == replies[1] == replies[2], replies
