"""What is in the model folder: installed catalog models, imported models, imports.

A model counts as installed when its file exists with the catalog's exact size
in bytes (one ``stat``, cheap enough for every start); the sha256 is checked
when fetching and on demand by :func:`verify`.  :func:`import_model` copies a
``.gguf`` file or a transformers-layout folder in atomically (a hidden temp
name, then a rename), after the checks every load runs (:mod:`models.safety`: pickled
checkpoints refused unopened, a GGUF's metadata within the scan's limits, no custom code).
"""
from __future__ import annotations

import filecmp
import hashlib
import logging
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from . import safety
from .catalog import CATALOG, DEFAULT_MODEL, CatalogEntry
from .hub.local import find_installed, hub_path, installed_files, read_manifest
from .hub.ref import HubRef
from .paths import bundled_models_dir, models_dir

__all__ = [
    "CHUNK_BYTES", "GGUF_MAGIC", "PICKLE_SUFFIXES", "ImportModelError", "ModelInfo",
    "import_model", "installed_path", "list_models", "verify",
]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes read or copied at a time."""
GGUF_MAGIC = b"GGUF"
"""The first 4 bytes of every GGUF file."""
PICKLE_SUFFIXES = safety.PICKLE_SUFFIXES
"""File name endings of pickled checkpoints: refused, never opened (unpickling runs code)."""

_WHAT_TO_GIVE = "give a .gguf file or a model folder in transformers layout (config.json + *.safetensors)"


class ImportModelError(Exception):
    """A model cannot be imported; ``str()`` is one line: what is wrong and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    """One row of :func:`list_models`.

    Attributes:
        id: catalog id, or the file/folder name for imported models.
        name: human-readable name.
        path: the installed file or folder, or None when not installed.
        installed: whether it can be loaded now.
        size_bytes: size on disk in bytes (the download size when not installed).
        source: ``"catalog"``, ``"imported"`` or ``"hub"`` (downloaded from the Hugging Face
            Hub by reference; ``id`` is then ``hf.co/OWNER/REPO/FILE``).
        license: the weights' license or terms (catalog models; "" when unknown).
        chat_template: whether it has a chat template (False: a base model, completion
            only); None when not known without loading it (imported models).
    """

    id: str
    name: str
    path: Path | None
    installed: bool
    size_bytes: int
    source: Literal["catalog", "imported", "hub"]
    license: str = ""
    chat_template: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``path`` as a string or None)."""
        data = asdict(self)
        data["path"] = str(self.path) if self.path is not None else None
        return data


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _file_of_size(path: Path, size_bytes: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size_bytes
    except OSError:
        return False


def installed_path(entry: CatalogEntry = DEFAULT_MODEL) -> Path | None:
    """The installed file of ``entry``, or None when missing or of the wrong size in bytes.

    A frozen app looks first in its bundled, read-only models folder
    (:func:`models.paths.bundled_models_dir`, checksummed when the app was built),
    then in the model folder.

    Raises:
        OSError: the model folder cannot be created.
    """
    bundled = bundled_models_dir()
    if bundled is not None and _file_of_size(bundled / entry.filename, entry.size_bytes):
        return bundled / entry.filename
    if entry.hub_repo:
        return _installed_hub(entry)
    path = models_dir() / entry.filename
    return path if _file_of_size(path, entry.size_bytes) else None


def _installed_hub(entry: CatalogEntry) -> Path | None:
    """A Hub entry's file, when its manifest says it arrived whole (and with the catalog's
    sha256, when the catalog has one)."""
    if entry.hub_file:
        path = hub_path(entry.hub_repo, entry.hub_file)
    else:  # picked by its quant tag when fetched
        found = find_installed(HubRef(entry.hub_repo, quant=entry.hub_quant))
        if found is None:
            return None
        path = found
    manifest = read_manifest(path)
    if manifest is None or not _file_of_size(path, int(manifest.get("size_bytes", -1))):
        return None
    return path if not entry.sha256 or manifest.get("sha256") == entry.sha256 else None


def verify(entry: CatalogEntry = DEFAULT_MODEL) -> bool:
    """True when ``entry`` is installed and its sha256 matches (reads the whole file): the
    catalog's, or for a Hub entry without one the Hub's LFS sha256 kept in its manifest."""
    path = installed_path(entry)
    expected = entry.sha256 or (str((read_manifest(path) or {}).get("sha256", "")) if path is not None else "")
    try:
        return path is not None and bool(expected) and _sha256_file(path) == expected
    except OSError:
        return False


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def list_models() -> list[ModelInfo]:
    """Catalog entries (installed or not), then other ``.gguf`` files and model folders,
    then files downloaded from the Hub by reference.

    Imported entries are the model folder's ``*.gguf`` files and sub-folders
    holding a ``config.json``, sorted by name; hidden names (temp files, downloads in
    progress) are skipped. Hub downloads are the ``hf.co/OWNER/REPO/FILE`` files whose
    size is their manifest's.

    Raises:
        OSError: the model folder cannot be created or read.
    """
    folder = models_dir()
    rows: list[ModelInfo] = []
    for entry in CATALOG:
        path = installed_path(entry)
        rows.append(ModelInfo(entry.id, entry.name, path, path is not None, entry.size_bytes, "catalog", entry.license,
                              entry.chat_template))
    catalog_files = {entry.filename for entry in CATALOG if not entry.hub_repo}
    for child in sorted(folder.iterdir(), key=lambda p: p.name.lower()):
        if child.name.startswith(".") or child.name in catalog_files:
            continue
        try:
            if child.is_file() and child.suffix.lower() == ".gguf":
                rows.append(ModelInfo(child.name, child.stem, child, True, child.stat().st_size, "imported"))
            elif child.is_dir() and (child / "config.json").is_file():
                rows.append(ModelInfo(child.name, child.name, child, True, _tree_bytes(child), "imported"))
        except OSError as exc:
            log.warning("skipping %s: %s", child, exc)
    catalog_hub = {(r.path.parent, r.path.name) for r in rows if r.source == "catalog" and r.path is not None}
    for f in installed_files(folder=folder):
        if (f.path.parent, f.path.name) in catalog_hub or not f.complete:
            continue
        rows.append(ModelInfo(f.ref, f.path.stem, f.path, True, f.size_bytes, "hub",
                              str((f.manifest or {}).get("license") or "")))
    return rows


def _os_error(action: str, exc: OSError) -> ImportModelError:
    reason = " ".join(str(exc.strerror or exc).split())
    return ImportModelError(f"could not {action} ({reason}); free some disk space or check permissions")


def _check_catalog_name(src: Path, name: str) -> None:
    """Refuse a file named like a catalog model whose size or sha256 differs."""
    for entry in CATALOG:
        if entry.filename == name and (src.stat().st_size != entry.size_bytes
                                       or _sha256_file(src) != entry.sha256):
            raise ImportModelError(f"{src} has the name of the catalog model {entry.id} but not its "
                                   "checksum; rename the file or use `attnchat models fetch`")


def _check(src: Path) -> None:
    """The rules every load runs (:func:`models.safety.check_model`), before anything is copied."""
    try:
        safety.check_model(src)
    except safety.Refused as exc:
        raise ImportModelError(f"{exc}; nothing was imported") from None
    except OSError as exc:
        raise ImportModelError(f"cannot read {src} ({exc.strerror}); check its permissions") from exc


def _import_file(src: Path, folder: Path) -> Path:
    suffix = src.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise ImportModelError(f"{src} is a pickled checkpoint ({suffix}), refused because loading it "
                               f"could run code; {_WHAT_TO_GIVE}")
    try:
        with open(src, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ImportModelError(f"cannot read {src} ({exc.strerror}); check its permissions") from exc
    if magic != GGUF_MAGIC:
        raise ImportModelError(f"{src} is not a GGUF file (it does not start with b'GGUF'); {_WHAT_TO_GIVE}")
    _check(src)
    name = src.name if suffix == ".gguf" else src.name + ".gguf"
    _check_catalog_name(src, name)
    dest = folder / name
    if dest.exists():
        if dest.is_file() and (os.path.samefile(src, dest) or filecmp.cmp(src, dest, shallow=False)):
            return dest
        raise ImportModelError(f"{dest} already exists; remove it first or rename the file to import")
    tmp = folder / f".{name}.{os.getpid()}.import"
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK_BYTES)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        raise _os_error(f"copy {src} to {dest}", exc) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _files_to_copy(src: Path) -> list[Path]:
    """The regular files under ``src`` (relative paths), pickles left out.

    Only what is really inside the folder is copied: a link (to a file or a folder,
    inside or outside it) or anything that is not a regular file (a FIFO, a device such
    as ``/dev/zero``) refuses the whole import, before anything is written. Following
    links once copied a ``home -> /root`` link's 7.4 GB and a 0600 file of someone else's.

    Raises:
        ImportModelError: a link or a special file in the folder.
    """
    keep, skipped = [], []
    for root, dirs, files in os.walk(src):  # does not enter links to folders
        dirs.sort()
        for name in sorted(dirs) + sorted(files):
            path = Path(root) / name
            rel = path.relative_to(src)
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise ImportModelError(f"{src} holds a link, {str(rel)!r}; attnchat imports only the regular "
                                       "files inside a folder: replace the link with the file it points to")
            if name in dirs:
                continue
            if not stat.S_ISREG(mode):
                raise ImportModelError(f"{src} holds {str(rel)!r}, which is not a regular file; "
                                       "remove it from the folder and import again")
            (skipped if path.suffix.lower() in PICKLE_SUFFIXES else keep).append(rel)
    if skipped:
        log.info("not copying pickled files %r from %r", [str(p) for p in skipped], str(src))
    return keep


def _copy_file(src: Path, dest: Path) -> None:
    """Copy one regular file, refusing it if it became a link meanwhile (O_NOFOLLOW)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    with open(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise ImportModelError(f"{str(src)!r} is not a regular file; remove it from the folder and import again")
        with open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK_BYTES)


def _import_folder(src: Path, folder: Path) -> Path:
    if not (src / "config.json").is_file():
        raise ImportModelError(f"{src} has no config.json, so it is not a model folder; {_WHAT_TO_GIVE}")
    if not any(src.glob("*.safetensors")):
        raise ImportModelError(f"{src} has no *.safetensors weights (pickled .bin/.pt weights are "
                               "refused); convert them to safetensors or use a .gguf file")
    dest = folder / src.name
    if dest.exists():
        if os.path.samefile(src, dest):
            return dest
        raise ImportModelError(f"{dest} already exists; remove it first or rename the folder to import")
    files = _files_to_copy(src)
    _check(src)
    tmp = folder / f".{src.name}.{os.getpid()}.import"
    try:
        tmp.mkdir()
        for rel in files:
            _copy_file(src / rel, tmp / rel)
        os.rename(tmp, dest)
    except OSError as exc:
        raise _os_error(f"copy {src} to {dest}", exc) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def import_model(path: str | os.PathLike[str]) -> Path:
    """Copy a ``.gguf`` file or a transformers-layout folder into the model folder.

    Returns the new path (or the existing one when identical content is already
    there).  Pickled files inside an imported folder are not copied.

    Raises:
        ImportModelError: the path is missing, a file is not GGUF (checked by
            its 4-byte magic) or is a pickled checkpoint (``.bin``/``.pt``/
            ``.pth``/``.ckpt``, never opened), a GGUF's metadata or a folder's
            JSON fails :mod:`models.safety`'s rules (nothing is copied), a folder
            lacks ``config.json`` or safetensors weights, the name is taken, or
            copying failed.
        OSError: the model folder cannot be created.
    """
    src = Path(path).expanduser()
    if not src.exists():
        raise ImportModelError(f"{src}: no such file or folder; {_WHAT_TO_GIVE}")
    src = src.resolve()
    if not src.is_dir() and not src.is_file():
        raise ImportModelError(f"{src} is not a regular file (a device or a pipe?); {_WHAT_TO_GIVE}")
    folder = models_dir()
    dest = _import_folder(src, folder) if src.is_dir() else _import_file(src, folder)
    log.info("imported %r as %r", str(src), str(dest))  # repr: a newline in a name cannot forge a log line
    return dest
