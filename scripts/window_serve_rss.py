"""The desktop app's resident memory before and after Server > Serve the loaded model.

Builds the app's window headless (offscreen) with the engine the app uses, loads the default
model (as the app loads it: the file's own blocks), writes one chat reply, then reads this
process's RSS (``/proc/self/status`` VmRSS): before serving, once serving from this process,
and after one request to the server. With ``--process`` it also serves through the fallback
(``attnchat serve`` as a child process) and reads that child's RSS. Linux only. Usage::

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/window_serve_rss.py [--process]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx2 as httpx  # noqa: E402


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process", action="store_true", help="also measure the process server's child")
    args = p.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QEventLoop

    from attnchat.server.in_process import for_window
    from desktop.app import application, build_window
    from desktop.chat.store import Store
    from desktop.settings.values import Settings
    from models import fetch

    app = application(headless=True)
    tmp = Path(tempfile.mkdtemp())

    def settle(until, timeout_s: float = 600) -> None:
        end = time.monotonic() + timeout_s
        while not until() and time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            time.sleep(0.02)
        if not until():
            raise TimeoutError("timed out")

    def ask(url: str, model: str) -> None:
        r = httpx.post(f"{url}/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0})
        r.raise_for_status()

    out: dict = {}
    window = build_window(Store(tmp / "chat.sqlite3"), Settings(tmp / "chat.ini"), confirm=lambda q: True,
                          serve_factory=for_window)
    window.settings.set("model/device", "cpu")
    window.generation_overrides = {"max_new_tokens": 32, "temperature": 0.0}
    window.show()
    loaded: list = []
    window.engine.model_loaded.connect(loaded.append)
    window.load_model(str(fetch.ensure_default()))
    settle(lambda: bool(loaded))
    out["model"], out["weights_dtype"] = loaded[0]["name"], loaded[0]["dtype"]
    done: list = []
    window.reply_finished.connect(done.append)
    window.submit("What is the capital of France?")
    settle(lambda: bool(done))
    time.sleep(1)
    out["app_rss_mib_before_serving"] = round(rss_mib(), 1)
    toggle = window.serve_toggle
    toggle.action.trigger()
    settle(lambda: toggle.server.state != "starting")
    assert toggle.server.state == "serving" and toggle.server.in_process, toggle.server.error
    time.sleep(1)
    out["app_rss_mib_serving"] = round(rss_mib(), 1)
    ask(toggle.server.url, toggle.server.model_id)
    time.sleep(1)
    out["app_rss_mib_serving_after_a_request"] = round(rss_mib(), 1)
    toggle.action.trigger()
    settle(lambda: toggle.server.state == "stopped", 30)
    if args.process:
        toggle.local = None   # as a window the attnchat command did not start: the process server
        toggle.action.trigger()
        settle(lambda: toggle.server.state != "starting")
        assert toggle.server.state == "serving" and not toggle.server.in_process, toggle.server.error
        ask(toggle.server.url, toggle.server.model_id)
        time.sleep(1)
        out["app_rss_mib_process_server"] = round(rss_mib(), 1)
        out["child_rss_mib_process_server"] = round(rss_mib(toggle.server.pid), 1)
        toggle.shutdown()
    window.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
