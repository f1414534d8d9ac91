"""Conversations and logs are readable by their user alone: the data and log
folders 0700, the database (and its -wal/-shm) and the log file 0600, on creation and
repaired on start when an older version left them open to other users.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from models import logfile, paths

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """The umask of a system whose home folders are open to others (Debian's 022)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _write_a_conversation(data: Path) -> Path:
    from desktop.app import open_store

    store = open_store()
    try:
        conv = store.create_conversation("secret")
        store.add_message(conv.id, "user", "My bank PIN is 4817")
        db = data / "conversations.sqlite3"
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
        assert all(f.exists() for f in files)  # WAL: the open store has all three
        return db
    finally:
        store.close()


def test_a_new_database_is_private(tmp_path, monkeypatch, open_umask):
    data = tmp_path / "share" / "attnchat"
    monkeypatch.setenv("ATTNCHAT_DATA_DIR", str(data))
    from desktop.app import open_store

    store = open_store()
    conv = store.create_conversation("secret")
    store.add_message(conv.id, "user", "My bank PIN is 4817")
    db = data / "conversations.sqlite3"
    modes = {p.name: _mode(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))}
    store.close()
    assert _mode(data) == 0o700
    assert modes == {"conversations.sqlite3": 0o600, "conversations.sqlite3-wal": 0o600,
                     "conversations.sqlite3-shm": 0o600}


def test_open_files_of_an_older_version_are_repaired_on_start(tmp_path, monkeypatch, open_umask):
    data = tmp_path / "attnchat"
    monkeypatch.setenv("ATTNCHAT_DATA_DIR", str(data))
    db = _write_a_conversation(data)
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if p.exists():
            p.chmod(0o644)
    data.chmod(0o755)
    from desktop.app import open_store

    store = open_store()
    try:
        assert _mode(data) == 0o700
        for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert _mode(p) == 0o600, p.name
        assert [c.title for c in store.conversations()] == ["secret"]
    finally:
        store.close()


def test_the_log_file_is_private(tmp_path, monkeypatch, open_umask):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    log_dir = paths.log_dir()
    assert str(log_dir).startswith(str(tmp_path)) and _mode(log_dir) == 0o700
    old = log_dir / logfile.LOG_NAME
    old.write_text("an older log\n")
    old.chmod(0o644)
    log_dir.chmod(0o755)
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        path = logfile.to_file()
        logging.getLogger("attnchat.test").warning("a record")
        assert path == old and _mode(path) == 0o600 and _mode(log_dir) == 0o700
        assert "a record" in path.read_text()
    finally:
        for h in root.handlers[:]:
            if h not in before:
                root.removeHandler(h)
                h.close()


def test_the_settings_file_is_private(tmp_path, open_umask):
    """~/.config/attnchat/attnchat.conf holds the system prompt and the model's path: 0600 in a
    0700 folder whatever the umask, repaired when found open, and kept so when QSettings rewrites it."""
    from desktop.settings.values import Settings

    file = tmp_path / "config" / "attnchat" / "attnchat.conf"
    settings = Settings(file)
    settings.set("generation/system_prompt", "my medical history: ...")
    settings.sync()
    assert (_mode(file.parent), _mode(file)) == (0o700, 0o600)
    assert "medical history" in file.read_text()
    file.chmod(0o644)  # as an older version left them
    file.parent.chmod(0o755)
    again = Settings(file)
    assert (_mode(file.parent), _mode(file)) == (0o700, 0o600)
    assert again.get("generation/system_prompt") == "my medical history: ..."
    again.set("generation/max_new_tokens", 7)
    again.sync()  # QSettings writes a new file: it keeps the mode
    assert _mode(file) == 0o600


def test_the_cache_folder_is_private(tmp_path, monkeypatch, open_umask):
    """The cache folders (converted tokenizers and chat templates: which models one runs) are 0700
    whatever the umask, repaired when found open, the default and a folder the environment names."""
    monkeypatch.delenv(paths.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = paths.cache_dir()
    assert cache == tmp_path / "cache" / "attnchat" and _mode(cache) == 0o700
    cache.chmod(0o755)
    assert _mode(paths.cache_dir()) == 0o700
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert _mode(paths.cache_dir()) == 0o700
