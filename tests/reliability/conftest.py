"""Fixtures for the reliability tests: the desktop fixtures (a window on a fake or real worker,
no QThread left running), tiny real models, and a private log folder."""
from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from tests.desktop.conftest import _pyside_none_guard, make_window, no_qthread_left  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Nothing the loader caches lands in the user's cache folder."""
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny seeded random Llama in transformers' layout (128-token context, a chat template)."""
    from tests.runtime.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="session")
def tiny_without_template(tmp_path_factory):
    """The tiny Llama with its chat template removed."""
    from tests.runtime.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("plain"), "llama")
    for f in folder.glob("chat_template.*"):
        f.unlink()
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    return folder


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    """The user log folder moved under tmp_path; log handlers added by the test are removed after."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from models import paths

    yield paths.log_dir()
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
