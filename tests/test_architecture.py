"""The direction of imports (DESIGN.md): desktop -> runtime -> models, nothing points back.

Checked two ways: what a fresh interpreter really has in ``sys.modules`` after an
import, and import-linter's static contracts in pyproject.toml.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[1]
QT = ("PySide6", "shiboken6", "pyqtgraph")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)


def _loaded_after(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Top-level names from ``watched`` that are in sys.modules after running ``imports``."""
    code = (
        f"import json, sys\n{imports}\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(watched)!r})))"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_runtime_never_imports_qt():
    imports = (
        "import pkgutil, importlib, runtime, runtime.generate.session\n"
        "for m in pkgutil.walk_packages(runtime.__path__, 'runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "import torch; assert 'runtime.model.decoder' in sys.modules and 'runtime.insight.explain' in sys.modules"
    )
    assert _loaded_after(imports, QT + ("desktop", "torch")) == ["torch"]


def test_models_never_imports_torch():
    imports = (
        "import pkgutil, importlib, models\n"
        "for m in pkgutil.iter_modules(models.__path__):\n"
        "    importlib.import_module('models.' + m.name)\n"
        "assert 'models.fetch' in sys.modules"
    )
    heavy = ("torch", "transformers", "gguf", "safetensors", "runtime", "desktop") + QT
    assert _loaded_after(imports, heavy) == []


def test_the_check_sees_an_import():
    """The control: the same check does report a package that was imported."""
    assert _loaded_after("import email, csv", ("csv", "email", "torch")) == ["csv", "email"]


def test_import_linter_contracts_kept():
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        exe = ROOT / ".venv" / "bin" / "lint-imports"
    r = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for contract in (
        "Layers: command line -> desktop -> runtime -> models KEPT",
        "runtime never imports Qt KEPT",
        "models imports neither torch nor transformers KEPT",
        "no import cycles between sibling modules of runtime and desktop KEPT",
    ):
        assert contract in out, out
    assert "0 broken" in out, out


#: Lines a module may hold (STYLE.md: one idea a file, ~450 lines at most).
MAX_MODULE_LINES = 460


def test_no_module_is_longer_than_one_idea():
    long = {}
    for package in ("runtime", "attnchat", "desktop", "models"):
        for path in (ROOT / package).rglob("*.py"):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_MODULE_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert long == {}, f"split these by idea: {long}"
