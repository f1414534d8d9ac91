"""The models package must stay light: importing it never imports torch or Qt."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]

CODE = (
    "import models, models.fetch, models.catalog, models.paths, models.store, sys; "
    "heavy = sorted(m for m in ('torch', 'transformers', 'PySide6', 'gguf', 'numpy') if m in sys.modules); "
    "assert not heavy, heavy"
)


def test_importing_models_imports_neither_torch_nor_qt():
    result = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_models_cli_imports_neither_torch_nor_qt():
    code = CODE.replace("import models,", "import attnchat.cli.models, attnchat.fetching, models,")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_hub_layer_imports_neither_torch_nor_qt():
    """models.hub and the parts of huggingface_hub it uses (imported inside its functions)."""
    code = CODE.replace("import models,", "import models.hub.api, models.hub.download, huggingface_hub.file_download, "
                        "huggingface_hub.hf_api, huggingface_hub.utils, models,")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


def test_the_hub_layer_sends_no_telemetry(monkeypatch):
    """huggingface_hub's user agent would otherwise fetch an "agent harnesses" list from the
    Hub (telemetry): models.hub turns it off unless the user chose."""
    from huggingface_hub import constants

    from models.hub import api

    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    api._no_telemetry()
    assert constants.HF_HUB_DISABLE_TELEMETRY is True
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "0")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    api._no_telemetry()
    assert constants.HF_HUB_DISABLE_TELEMETRY is False
