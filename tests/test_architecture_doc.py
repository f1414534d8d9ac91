"""docs/architecture.md names what is in the tree: every path it names exists, every module of
runtime/, models/ and attnchat/ is named by its path, and every package (a folder with an
``__init__.py``) of the four top-level packages is named (desktop/ is described by package)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("attnchat", "desktop", "runtime", "models")
PATH = re.compile(r"`((?:%s)/[\w/]*(?:\.py|/)?)`" % "|".join(TOPS))


def _named() -> set[str]:
    return set(PATH.findall((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")))


def test_every_path_it_names_exists():
    missing = sorted(p for p in _named() if not (ROOT / p).exists())
    assert missing == []
    assert len(_named()) > 60  # the runtime table alone names more than that


def test_every_package_is_named():
    packages = {f"{init.parent.relative_to(ROOT).as_posix()}/" for top in TOPS
                for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert "runtime/cache/policies/" in packages
    assert sorted(packages - _named()) == []


def test_every_module_below_the_desktop_is_named():
    modules = {p.relative_to(ROOT).as_posix() for top in ("attnchat", "runtime", "models")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"}
    assert "runtime/loader/choose.py" in modules
    assert sorted(modules - _named()) == []
