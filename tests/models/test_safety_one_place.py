"""One place: every rule on whether a model file, folder, chat template or key file
may be used lives in models/safety, and every entry point reaches it. Read from the source (AST),
so a new entry point that renders a template or reads a model its own way fails here.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "attnchat", "desktop", "models", "packaging")
SAFETY = ROOT / "models" / "safety"

#: Entry point -> the rules (``safety.NAME``) it must call.
ENTRY_POINTS = {
    "runtime/weights/sources.py": {"check_folder", "refuse_pickle"},  # chat, serve, bench, desktop
    "runtime/weights/checked.py": {"check_gguf"},  # every GGUF before a reader opens it (gguf/open.py, converted.py)
    "runtime/generate/chat_format.py": {"render_template"},  # every template render, the tool probe
    "models/store.py": {"check_model"},  # attnchat models import, File > Import
    "models/hub/download.py": {"check_model"},  # Hub downloads
    "attnchat/server/command.py": {"check_key_file"},  # serve --api-key-file
}


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module outside models/safety, parsed once (~1.5 s here) for the tests below."""
    return tuple((file, ast.parse(file.read_text(encoding="utf-8"))) for package in PACKAGES
                 for file in sorted((ROOT / package).rglob("*.py")) if SAFETY not in file.parents)


def test_no_template_is_rendered_outside_the_sandbox():
    """Neither jinja2 nor transformers' template rendering is used outside models/safety: a
    template rendered in this process could take gigabytes."""
    found = []
    for file, tree in _modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            if any(n.split(".")[0] == "jinja2" or n in ("apply_chat_template", "render_jinja_template",
                                                          "_compile_jinja_template") for n in names):
                found.append(f"{file.relative_to(ROOT)}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_calls_the_rules(entry):
    tree = ast.parse((ROOT / entry).read_text(encoding="utf-8"))
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "safety"}
    assert ENTRY_POINTS[entry] <= called, f"{entry} calls {sorted(called)}"


def test_the_limits_are_defined_only_in_models_safety():
    """A limit on model files (MAX_VOCAB, MAX_JSON_BYTES, TEMPLATE_MEMORY_BYTES...) assigned
    anywhere else would be a second rule that can drift from the first."""
    from models.safety import custom_code, gguf_scan, template

    limits = {name for module in (custom_code, gguf_scan, template) for name in vars(module)
              if name.startswith(("MAX_", "TEMPLATE_"))}
    assert {"MAX_VOCAB", "MAX_JSON_BYTES", "MAX_TEMPLATE_CHARS", "TEMPLATE_MEMORY_BYTES"} <= limits
    found = []
    for file, tree in _modules():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            found += [f"{file.relative_to(ROOT)}:{node.lineno} {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id in limits]
    assert found == []


@pytest.mark.parametrize("reader", ["runtime/weights/gguf/open.py", "runtime/weights/gguf/converted.py"])
def test_every_gguf_reader_checks_the_file_first(reader):
    """The GGUF rule lives in weights/checked.py: each reader of a GGUF calls it."""
    tree = ast.parse((ROOT / reader).read_text(encoding="utf-8"))
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "check_gguf_file" in called, reader
