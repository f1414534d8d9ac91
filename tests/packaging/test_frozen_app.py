"""What only the frozen app does: find the bundled model, force the hubs offline, run
``--attnchat-run-module attnchat.bench.worker`` (how ``attnchat bench`` starts workers: the
app's own flag, not Python's ``-m``), freeze support."""
from __future__ import annotations

import os
import sys

import pytest

import models
from models import fetch, paths, store

from .conftest import load


@pytest.fixture
def frozen(tmp_path, monkeypatch):
    """Pretend to be a PyInstaller bundle whose _MEIPASS is tmp_path/bundle; the user folder is empty."""
    meipass = tmp_path / "bundle"
    meipass.mkdir()
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(meipass), raising=False)
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(tmp_path / "user-models"))
    return meipass


def _sparse(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_not_frozen_has_no_bundled_folder(tmp_path, monkeypatch):
    monkeypatch.delattr(sys, "frozen", raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    (tmp_path / paths.BUNDLED_MODELS_SUBDIR).mkdir()
    assert paths.bundled_models_dir() is None


def test_frozen_without_a_models_folder(frozen):
    assert paths.bundled_models_dir() is None


def test_frozen_finds_the_bundled_default_model(frozen, monkeypatch):
    bundled = _sparse(frozen / paths.BUNDLED_MODELS_SUBDIR / models.DEFAULT_MODEL.filename,
                      models.DEFAULT_MODEL.size_bytes)
    assert paths.bundled_models_dir() == frozen / paths.BUNDLED_MODELS_SUBDIR
    assert models.installed_path() == bundled

    def no_fetch(*a, **k):
        raise AssertionError("must not fetch: the model is bundled")

    monkeypatch.setattr(fetch, "fetch", no_fetch)
    assert models.ensure_default() == bundled
    rows = {r.id: r for r in models.list_models()}
    assert rows[models.DEFAULT_MODEL.id].installed and rows[models.DEFAULT_MODEL.id].path == bundled
    assert list((frozen / paths.BUNDLED_MODELS_SUBDIR).iterdir()) == [bundled]  # nothing written there


def test_a_wrong_size_bundled_file_falls_back_to_the_user_folder(frozen, tmp_path):
    _sparse(frozen / paths.BUNDLED_MODELS_SUBDIR / models.DEFAULT_MODEL.filename, 10)
    assert models.installed_path() is None
    user = _sparse(tmp_path / "user-models" / models.DEFAULT_MODEL.filename, models.DEFAULT_MODEL.size_bytes)
    assert store.installed_path() == user


@pytest.fixture
def entry():
    return load("attnchat_frozen_entry", "entry.py")


def test_entry_forces_hubs_offline_before_the_cli(entry, monkeypatch):
    import attnchat.cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    seen = {}

    monkeypatch.delenv("ATTNCHAT_HUB_OFFLINE_BY_APP", raising=False)
    seen = {}

    def fake_cli():
        seen.update(hub=os.environ.get("HF_HUB_OFFLINE"), transformers=os.environ.get("TRANSFORMERS_OFFLINE"),
                    by_app=os.environ.get("ATTNCHAT_HUB_OFFLINE_BY_APP"))
        return 7

    monkeypatch.setattr(attnchat.cli, "main", fake_cli)
    monkeypatch.setattr(sys, "argv", ["attnchat", "--self-test"])
    assert entry.main() == 7
    # The libraries go offline; attnchat's own Hub requests may still go out (models.hub.api).
    assert seen == {"hub": "1", "transformers": "1", "by_app": "1"}
    # A user who switched the Hub off keeps it off for attnchat's requests too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ATTNCHAT_HUB_OFFLINE_BY_APP")
    assert entry.main() == 7
    assert seen == {"hub": "1", "transformers": "1", "by_app": None}


def test_entry_gives_multiprocessing_freeze_support(entry, monkeypatch):
    import multiprocessing

    import attnchat.cli

    calls = []
    monkeypatch.setattr(multiprocessing, "freeze_support", lambda: calls.append(1))
    monkeypatch.setattr(attnchat.cli, "main", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["attnchat"])
    assert entry.main() == 0 and calls == [1]


@pytest.mark.parametrize("module", ["attnchat.bench.worker", "models.safety.template_worker"])
def test_entry_runs_the_bench_worker_module(entry, monkeypatch, module):
    import runpy

    from models.child import FROZEN_MODULE_FLAG, python_command

    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.append((name, list(sys.argv))))
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/attnchat/attnchat")
    argv = python_command(module, "--engine", "ours")   # what the app starts its child with
    assert argv == ["/opt/attnchat/attnchat", FROZEN_MODULE_FLAG, module, "--engine", "ours"] and "-m" not in argv
    monkeypatch.setattr(sys, "argv", argv)
    assert entry.main() == 0
    assert ran == [(module, ["/opt/attnchat/attnchat", "--engine", "ours"])]


def test_entry_refuses_other_modules(entry, monkeypatch):
    import attnchat.cli

    from models.child import FROZEN_MODULE_FLAG

    monkeypatch.setattr(attnchat.cli, "main", lambda: 2)  # argparse would reject the flag
    monkeypatch.setattr(sys, "argv", ["attnchat", FROZEN_MODULE_FLAG, "os"])
    assert entry.main() == 2
