"""The desktop app's entry point: ``main(args) -> int``.

Runs ``--self-test`` (:mod:`desktop.selftest`), ``--screenshot DIR``
(:mod:`desktop.screenshots`) or the window (:mod:`desktop.app`); it sits above all three so
that none of them imports another's caller. Must not import torch.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import sqlite3
import sys

from PySide6.QtWidgets import QMessageBox

from desktop.app import DATA_DIR_ENV, application, build_window, offer_download, open_store, report_unexpected, start_model
from desktop.chat.store import SchemaTooNewError
from desktop.qt_preflight import platform_problem
from desktop.settings.values import Settings
from models import logfile

__all__ = ["exit_now", "main", "quiet_terminal"]

log = logging.getLogger(__name__)


def quiet_terminal() -> None:
    """Library messages go to the log file, not to the terminal the window was started from:
    huggingface_hub gives its logger a stderr handler of its own, so a download's retries
    ("Retrying in 1s [Retry 1/5]") printed there. Its records still reach the log file (they
    propagate to the root logger), as do ``warnings`` (captured into logging)."""
    logging.captureWarnings(True)
    try:
        import huggingface_hub.utils.logging  # noqa: F401 - adds that handler once, at import
    except ImportError:
        return
    hub = logging.getLogger("huggingface_hub")
    for h in list(hub.handlers):
        if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__):
            hub.removeHandler(h)
    hub.propagate = True


def _no_display() -> bool:
    """Linux/BSD without X11 or Wayland, and no platform chosen: Qt would abort."""
    if not sys.platform.startswith(("linux", "freebsd")) or os.environ.get("QT_QPA_PLATFORM"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def main(args: argparse.Namespace, *, serve_factory=None) -> int:
    """Run the desktop app; returns the exit status.

    ``serve_factory``: ``(model, *, port, api_key, options) -> server`` for Server > Serve the loaded
    model from this process (the command line hands in :func:`attnchat.server.in_process.for_window`;
    without one the toggle runs ``attnchat serve`` as a child process, and says so)."""
    logfile.to_file()   # tracebacks go to the log file, never to the window or the terminal
    headless = getattr(args, "self_test", False) or getattr(args, "screenshot", None)
    problem = platform_problem(window=not headless)
    if problem:   # Qt would abort (SIGABRT, nothing said): say what is wrong instead
        print(f"attnchat: error: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "self_test", False):
        from desktop.selftest import run as self_test

        return self_test(args)
    if getattr(args, "screenshot", None):
        from desktop.screenshots import run as screenshots

        return screenshots(args, serve_factory=serve_factory)
    if _no_display():
        print("attnchat: error: no display found (DISPLAY and WAYLAND_DISPLAY are unset); "
              "run `attnchat --terminal` to chat in the terminal", file=sys.stderr)
        return 2
    quiet_terminal()
    app = application()
    try:
        store = open_store()
    except (sqlite3.DatabaseError, SchemaTooNewError, OSError) as e:
        log.exception("could not open the conversation database")
        QMessageBox.critical(None, "attnchat", f"The conversation database could not be opened: {e}")
        print(f"attnchat: error: the conversation database could not be opened ({e}); "
              f"move it aside or set {DATA_DIR_ENV}", file=sys.stderr)
        return 2
    settings = Settings()
    if getattr(args, "device", None) and args.device != "auto":
        settings.set("model/device", args.device)
    window = build_window(store, settings, serve_factory=serve_factory)
    window.download_requested.connect(lambda: offer_download(window))
    previous_hook = sys.excepthook
    sys.excepthook = lambda *exc: report_unexpected(window, *exc)
    window.fit_to_screen()   # a new user's default size, within a small screen with its title bar
    window.show()
    start_model(window, getattr(args, "model", None))
    try:
        rc = app.exec()
    finally:
        window.close()
        store.close()
        sys.excepthook = previous_hook
    exit_now(rc)


def exit_now(rc: int) -> None:
    """End the process now that the window is closed and everything is saved (the
    conversation database closed, the settings synced, the engine thread ended): the exit
    handlers run (the template sandbox's child, logging) and the output is flushed, but
    Python's teardown of torch, Qt and the thread pools is skipped: it took 4-9 s after the
    window was gone (measured: 4.7 s on 2 vCPUs), which read as a hung Quit."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(rc)
