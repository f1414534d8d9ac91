"""Tracebacks go to the log file in the user's log folder, never to the user: the app sets the
log file up, and unexpected failures (in the worker, in a Qt slot) are logged with their
traceback there and shown in one line."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pytest

import desktop.app
import desktop.launch
from desktop.worker import EngineWorker
from models import logfile
from tests.desktop.fakes import fake_load, fake_session_factory


def file_handlers() -> list[Path]:
    return [Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def test_the_app_logs_to_attnchat_log_in_the_user_log_folder(log_dir, monkeypatch, capsys):
    monkeypatch.setattr(desktop.launch, "_no_display", lambda: True)   # return before any window opens
    args = argparse.Namespace(self_test=False, screenshot=None, device="auto", model=None, terminal=False)
    assert desktop.launch.main(args) == 2
    assert "no display" in capsys.readouterr().err
    path = log_dir / "attnchat.log"
    assert file_handlers().count(path) == 1
    logging.getLogger("desktop.worker").info("a line for the log")
    assert "a line for the log" in path.read_text()
    assert logfile.to_file() == path and file_handlers().count(path) == 1   # set up once, however often asked


def test_an_unwritable_log_folder_is_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocker))
    before = list(logging.getLogger().handlers)
    assert logfile.to_file() is None and logging.getLogger().handlers == before


@pytest.fixture
def logged(log_dir) -> Path:
    path = logfile.to_file()
    assert path == log_dir / "attnchat.log"
    return path


def test_an_unexpected_worker_error_is_logged_with_its_traceback_and_shown_in_one_line(qtbot, make_window, logged):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=fake_session_factory(fail=KeyError("layers.7.attn"))))
    w.input.setPlainText("hello")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.input.submit()
    shown = w.notice.text()
    assert shown.startswith("The reply failed (KeyError") and "see the log" in shown and "\n" not in shown
    assert "Traceback" not in shown
    text = logged.read_text()
    assert "generation failed" in text and "Traceback (most recent call last)" in text
    assert "KeyError: 'layers.7.attn'" in text


def test_an_unexpected_load_error_is_logged_and_shown_in_one_line(qtbot, make_window, logged):
    def load(source, device):
        raise AttributeError("'NoneType' object has no attribute 'shape'\nmore detail")

    w = make_window(worker=EngineWorker(load_fn=load), load=False)
    with qtbot.waitSignal(w.engine.load_failed, timeout=5000):
        w.load_model("model.gguf")
    shown = w.notice.text()
    assert "AttributeError" in shown and "more detail" not in shown and "\n" not in shown
    assert "Traceback (most recent call last)" in logged.read_text() and "more detail" in logged.read_text()


def test_an_exception_escaping_a_slot_goes_to_the_log_and_the_window(make_window, logged):
    w = make_window()
    try:
        {}["missing"]
    except KeyError:
        desktop.app.report_unexpected(w, *sys.exc_info())
    shown = w.notice.text()
    assert shown.startswith("Something went wrong (KeyError") and str(logged) in shown and "\n" not in shown
    text = logged.read_text()
    assert "unexpected error" in text and "Traceback (most recent call last)" in text and "KeyError: 'missing'" in text
