"""Desktop test fixtures: a window on a scripted fake engine, everything under tmp_path,
and a check that no test leaves a QThread running."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from tests.desktop.fakes import fake_load, fake_session_factory  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _pyside_none_guard():
    """PySide6 6.12.0 on Python 3.11 drops a reference to None per void call (desktop.qt_compat)."""
    from desktop.qt_compat import guard_none_refcount

    guard_none_refcount()


@pytest.fixture(autouse=True)
def no_qthread_left(qapp, _pyside_none_guard):
    """Fail a test that leaves one of the app's QThreads running."""
    from desktop.worker import live_threads

    yield
    left = live_threads()
    for t in left:  # do not leak into the next test
        t.quit()
        t.wait(5000)
    assert not left, f"QThreads left running: {[t.objectName() for t in left]}"


@pytest.fixture
def make_window(qtbot, tmp_path):
    """``make(...)`` -> a MainWindow on a fake engine, with its database and settings in tmp_path.

    Keyword args: ``script`` (reply pieces), ``delay`` (s per piece), ``load`` (wait for the
    fake model), ``fail`` (an exception the session raises), ``worker`` (a ready EngineWorker),
    ``serve_factory`` (Server > Serve from this process, as the command line hands it).
    """
    from desktop.app import build_window
    from desktop.settings.values import Settings
    from desktop.chat.store import Store
    from desktop.worker import Engine, EngineWorker

    made = []

    def make(*, script=None, delay=0.002, load=True, fail=None, worker=None, db="chat.sqlite3", serve_factory=None):
        store = Store(tmp_path / db)
        settings = Settings(tmp_path / "settings.ini")
        worker = worker or EngineWorker(load_fn=fake_load, session_fn=fake_session_factory(script, delay, fail))
        window = build_window(store, settings, Engine(worker), confirm=lambda q: True, serve_factory=serve_factory)
        made.append((window, store))
        window.show()
        if load:
            with qtbot.waitSignal(window.engine.model_loaded, timeout=5000):
                window.load_model("fake.gguf")
        return window

    yield make
    for window, store in made:
        window.close()
        store.close()
