"""The models package must stay light: importing it never imports torch or Qt."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    code = CODE.replace("import models,", "import attnchat.cli.models, models,")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_hub_layer_imports_neither_torch_nor_qt():
    """models.hub and the parts of huggingface_hub it uses (imported inside its functions)."""
    code = CODE.replace("import models,", "import models.hub.api, models.hub.download, huggingface_hub.file_download, "
                        "huggingface_hub.hf_api, huggingface_hub.utils, models,")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
