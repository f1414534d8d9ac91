"""Fixtures for the packaging checks: packaging/*.py loaded by path (it is no package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"


def load(name: str, filename: str):
    """Load ``packaging/<filename>`` as module ``name`` (``packaging/`` must not shadow the library)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACKAGING / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bundle():
    return load("attnchat_bundle", "bundle.py")


@pytest.fixture(scope="session")
def builder(bundle):
    return load("attnchat_build_deb", "build_deb.py")


@pytest.fixture
def fake_app(tmp_path):
    """A stand-in for PyInstaller's one-folder output (a few bytes, not the real app)."""
    app = tmp_path / "app" / "attnchat"
    (app / "_internal" / "bundled_models").mkdir(parents=True)
    exe = app / "attnchat"
    exe.write_text("#!/bin/sh\necho attnchat\n")
    exe.chmod(0o755)
    (app / "_internal" / "libfake.so").write_bytes(b"\0" * 3000)
    (app / "_internal" / "bundled_models" / "model.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    return app
