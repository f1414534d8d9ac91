"""``attnchat --self-test``: the real window, the real worker, the default model, one question.

Headless (the offscreen platform unless another is set); settings and the database
live in a temporary folder, so the user's own are never touched. Exit status 0 when
the reply mentions Paris, 1 otherwise (with the reason on stderr). Must not import torch.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer

import models
from desktop.app import application, build_window
from desktop.settings.values import Settings
from desktop.chat.store import Store

__all__ = ["run", "QUESTION"]

QUESTION = "What is the capital of France?"
TIMEOUT_S = 600


def run(args: argparse.Namespace, timeout_s: float = TIMEOUT_S) -> int:
    app = application(headless=True)
    # Missing model: fetch it here (no dialog to click headless). FetchError -> the cli's one line.
    source = args.model or str(models.ensure_default())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attnchat-selftest-") as tmp:
        store = Store(Path(tmp) / "conversations.sqlite3")
        settings = Settings(Path(tmp) / "settings.ini")
        settings.set("model/device", getattr(args, "device", "auto") or "auto")
        window = build_window(store, settings, confirm=lambda q: True)
        window.generation_overrides = {"max_new_tokens": 32, "temperature": 0.0}
        outcome: dict = {}
        loop = QEventLoop()

        def fail(reason: str) -> None:
            outcome.setdefault("error", reason)
            loop.quit()

        def loaded(info: dict) -> None:
            outcome["model"] = info
            window.input.setPlainText(QUESTION)
            window.input.submit()
            if not window.replying:
                fail("the window did not start a reply")

        def finished(result: dict) -> None:
            outcome["result"] = result
            loop.quit()

        window.engine.model_loaded.connect(loaded)
        window.engine.load_failed.connect(lambda m: fail(f"the model did not load: {m}"))
        window.engine.error.connect(lambda m: fail(f"the reply failed: {m}"))
        window.reply_finished.connect(finished)
        QTimer.singleShot(int(timeout_s * 1000), lambda: fail(f"no reply within {timeout_s:.0f} s"))
        window.show()
        window.load_model(source)
        loop.exec()
        shown = ""
        if "result" in outcome and window.messages.rowCount():
            shown = window.messages.message(window.messages.rowCount() - 1)["content"]
        window.close()
        store.close()
    app.processEvents()
    elapsed = time.perf_counter() - t0
    if "error" in outcome:
        print(f"self-test FAILED: {outcome['error']}", file=sys.stderr)
        return 1
    result, info = outcome["result"], outcome["model"]
    text = result["text"]
    if "paris" not in text.lower() or "paris" not in shown.lower():
        print(f"self-test FAILED: {info['name']} on {info['device']} answered {text!r} "
              f"(the window shows {shown!r}); expected it to mention Paris", file=sys.stderr)
        return 1
    stats = result["stats"]
    print(f"self-test passed: {info['name']} on {info['device']} answered {text!r} in the window "
          f"(TTFT {stats.get('ttft_s', 0):.2f} s, {stats.get('decode_tokens_per_s', 0):.1f} tok/s, "
          f"{elapsed:.1f} s in all)")
    return 0
