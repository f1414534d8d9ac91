"""The command line of every Python child process attnchat starts. Stdlib only.

``python -m MODULE`` puts the current folder first on ``sys.path``, so a folder that holds
a ``models/``, ``runtime/``, ``attnchat/`` or ``desktop/`` package (a project of the user's,
a cloned repository) would run its own code in place of ours; so would an empty or
relative entry of ``PYTHONPATH`` (resolved against the current folder even under ``-P``).
A child therefore runs in isolated mode (``python -I``: no current folder, no ``PYTHON*``
variables, no user site-packages, no bytecode written) from an explicit entry that puts
only the folder our own packages were imported from in front of the interpreter's path,
then runs the module as ``-m`` would (:func:`runpy.run_module`). Extra folders a child
needs (another environment's packages) come after the interpreter's own, as absolute
paths, never through ``PYTHONPATH``.

A frozen app (PyInstaller) is no interpreter: its executable takes :data:`FROZEN_MODULE_FLAG`
``MODULE`` for the few modules it runs as children (packaging/entry.py), a flag of its own
rather than Python's ``-m`` (which it never parses), and the command line otherwise; it
imports only from its bundle.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["FROZEN_MODULE_FLAG", "ROOT", "attnchat_command", "python_command"]

#: The folder our packages (``models``, ``runtime``, ``desktop``, ``attnchat``) live in.
ROOT = str(Path(__file__).resolve().parent.parent)

#: The frozen app's argument that runs one of its modules as a child: ``APP FLAG MODULE ARGS...``.
FROZEN_MODULE_FLAG = "--attnchat-run-module"

# Run by ``python -I -c``: argv is ["-c", ROOT, EXTRA, MODULE, *ARGS]; EXTRA joined by os.pathsep.
_ENTRY = ("import os, runpy, sys\n"
          "root, extra, module = sys.argv[1:4]\n"
          "sys.argv = [sys.argv[0], *sys.argv[4:]]\n"
          "sys.path.insert(0, root)\n"
          "sys.path += [p for p in extra.split(os.pathsep) if os.path.isabs(p)]\n"
          "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def python_command(module: str, *args: str, paths: Sequence[str] = (), python: str | None = None) -> list[str]:
    """The argv that runs ``python -m module args...`` without importing from the current
    folder: ``[python, "-I", "-B", "-c", ENTRY, ROOT, EXTRA, module, *args]``: :data:`ROOT`
    first on the child's path, ``paths`` (absolute ones only: a relative one would be the
    current folder's) after the interpreter's own. ``python`` defaults to this interpreter;
    a frozen app gets ``[app, FROZEN_MODULE_FLAG, module, *args]``.

    Raises:
        ValueError: ``module`` is not a dotted module name (it is code's, never a user's).
    """
    if not module.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"{module!r} is not a module name")
    if getattr(sys, "frozen", False) and python is None:
        return [sys.executable, FROZEN_MODULE_FLAG, module, *args]
    extra = os.pathsep.join(p for p in paths if os.path.isabs(p))
    return [python or sys.executable, "-I", "-B", "-c", _ENTRY, ROOT, extra, module, *args]


def attnchat_command(*args: str) -> list[str]:
    """The argv of ``attnchat ARGS...`` as a child (``python -m attnchat``, isolated as
    :func:`python_command` says; a frozen app is its own command line)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, *args]
    return python_command("attnchat", *args)
