"""models.paths: environment overrides, platform defaults, folders created on demand."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import paths
from tests.hang import HANG_S


def test_models_dir_env_override_is_created(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b" / "models"
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(target))
    assert not target.exists()
    assert paths.models_dir() == target
    assert target.is_dir()


def test_models_dir_expands_user(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", "~/mymodels")
    assert paths.models_dir() == tmp_path / "mymodels"
    assert (tmp_path / "mymodels").is_dir()


@pytest.mark.parametrize("value", [None, "", "   "])
def test_models_dir_default_is_user_data_dir(tmp_path, monkeypatch, value):
    calls = []

    def fake_user_data_dir(appname, **kwargs):
        calls.append(appname)
        return str(tmp_path / "data" / appname)

    if value is None:
        monkeypatch.delenv("ATTNCHAT_MODELS_DIR", raising=False)
    else:
        monkeypatch.setenv("ATTNCHAT_MODELS_DIR", value)
    monkeypatch.setattr(paths.platformdirs, "user_data_dir", fake_user_data_dir)
    assert paths.models_dir() == tmp_path / "data" / "attnchat" / "models"
    assert calls == ["attnchat"]
    assert (tmp_path / "data" / "attnchat" / "models").is_dir()


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "c"))
    assert paths.cache_dir() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()

    monkeypatch.delenv("ATTNCHAT_CACHE_DIR")
    monkeypatch.setattr(paths.platformdirs, "user_cache_dir",
                        lambda appname, **kw: str(tmp_path / "cache" / appname))
    assert paths.cache_dir() == tmp_path / "cache" / "attnchat"
    assert (tmp_path / "cache" / "attnchat").is_dir()


def test_log_dir_uses_user_log_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(paths.platformdirs, "user_log_dir",
                        lambda appname, **kw: str(tmp_path / "log" / appname))
    assert paths.log_dir() == tmp_path / "log" / "attnchat"
    assert (tmp_path / "log" / "attnchat").is_dir()


def test_models_dir_raises_when_a_file_is_in_the_way(tmp_path, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(blocker / "models"))
    with pytest.raises(OSError):
        paths.models_dir()


def test_importing_creates_no_folders(tmp_path):
    """Nothing happens at import time: importing the package creates no folder."""
    env = dict(os.environ, ATTNCHAT_MODELS_DIR=str(tmp_path / "m"),
               ATTNCHAT_CACHE_DIR=str(tmp_path / "c"), HOME=str(tmp_path / "home"),
               XDG_DATA_HOME=str(tmp_path / "xdg"))
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", "import models, models.fetch, models.store, models.paths"],
                   check=True, env=env, cwd=root, timeout=HANG_S)
    assert list(tmp_path.iterdir()) == []
