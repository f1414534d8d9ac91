"""desktop/ uses only runtime's public API (runtime.__all__) and never imports torch itself."""
from __future__ import annotations

import ast
from pathlib import Path

import runtime

DESKTOP = Path(__file__).parents[2] / "desktop"


def test_desktop_uses_only_runtime_public_names_and_no_torch():
    for path in sorted(DESKTOP.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in ("torch", "transformers"), f"{path.name} imports {alias.name}"
                    assert alias.name == "runtime" or not alias.name.startswith("runtime."), f"{path.name}: {alias.name}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in ("torch", "transformers"), f"{path.name} imports {node.module}"
                assert not node.module.startswith("runtime."), f"{path.name} imports {node.module}"
                if node.module == "runtime":
                    for alias in node.names:
                        assert alias.name in runtime.__all__, f"{path.name} uses runtime.{alias.name}"
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "runtime":
                assert node.attr in runtime.__all__, f"{path.name} uses runtime.{node.attr}"
