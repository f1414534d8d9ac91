"""Where Hub downloads live in the model folder, and what is there. Stdlib only.

A file ``FILE`` of repo ``OWNER/REPO`` is kept as ``<models_dir>/hf.co/OWNER/REPO/FILE`` (the
reference's own shape, so two repos' ``model-Q4_K_M.gguf`` never collide), beside a hidden
``.FILE.json`` saying where it came from (repo, commit, sha256, size, license). A download
in progress is ``<models_dir>/.partial/SHA256.part``: hidden, never a model, named by the
content it will hold so an interrupted download resumes only into the same bytes.

Every name here comes from the Hub's answers, so every one is checked before it becomes a
path (:func:`hub_path`, :func:`part_path`): an owner, a repo and each folder of a file's
path in the repo must be a plain file name (:func:`models.paths.check_file_name`), a sha256
64 hex digits, and the resolved target must stay inside the model folder.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.errors import HubError
from models.paths import UnsafeNameError, check_file_name, inside, models_dir

from .ref import DEFAULT_QUANT, GGUFFile, HubFile, HubRef, RefError, choose, group_files

__all__ = ["HUB_DIRNAME", "LocalHubFile", "check_hub_names", "checked_files", "find_installed", "hub_path", "installed_files",
           "manifest_path", "part_path", "partial_bytes", "partial_dir", "read_manifest", "write_manifest"]

log = logging.getLogger(__name__)

HUB_DIRNAME = "hf.co"
PARTIAL_DIRNAME = ".partial"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_hub_names(repo_id: str, filename: str = "", sha256: str = "") -> None:
    """That ``repo_id`` is ``OWNER/REPO``, each folder and the name of ``filename`` (a path in
    the repo, ``/``-separated) a plain file name, and ``sha256`` empty or 64 hex digits.

    Raises:
        HubError: kind ``"name"``, one line naming what the Hub sent.
    """
    what, name = "repo id", repo_id
    try:
        parts = repo_id.split("/") if isinstance(repo_id, str) else [repo_id]
        if len(parts) != 2:
            raise UnsafeNameError(f"{repo_id!r} is not OWNER/REPO")
        for part in parts:
            check_file_name(part)
        what, name = "file", filename
        for part in filename.split("/") if filename else ():
            check_file_name(part)
    except UnsafeNameError as exc:
        raise HubError(f"the Hub lists the {what} {name!r} for hf.co/{repo_id!s}, which is not a path of plain file "
                       f"names ({exc}); nothing was fetched (check HF_ENDPOINT and any proxy)", "name") from None
    if sha256 and not _SHA256.fullmatch(sha256):
        raise HubError(f"the Hub sent {sha256!r} as the sha256 of hf.co/{repo_id}/{filename}, which is not one; "
                       "nothing was fetched (check HF_ENDPOINT and any proxy)", "name")


def checked_files(repo_id: str, files: list[HubFile]) -> list[HubFile]:
    """A listing's files whose names may become paths: a GGUF file whose path in the repo is
    not plain names, or whose sha256 is not one, refuses the whole listing (a Hub that sends
    one would send others); any other file with such a name is left out (never fetched).

    Raises:
        HubError: kind ``"name"``.
    """
    out = []
    for f in files:
        try:
            check_hub_names(repo_id, f.path, (f.sha256 or "").lower())
        except HubError:
            if not isinstance(f.path, str) or f.path.lower().endswith(".gguf"):
                raise
            log.warning("hf.co/%s lists %r, not a plain path; left out", repo_id, f.path)
            continue
        out.append(f)
    return out


def hub_path(repo_id: str, filename: str, folder: Path | None = None) -> Path:
    """``<models_dir>/hf.co/OWNER/REPO/FILENAME`` (no folder is created but the model folder),
    each name checked (:func:`check_hub_names`) and the target inside the model folder.

    Raises:
        HubError: kind ``"name"``: a name is not a plain file name, or the path leads out.
    """
    check_hub_names(repo_id, filename)
    base = folder or models_dir()
    try:
        return inside(base, HUB_DIRNAME, *repo_id.split("/"), *filename.split("/"))
    except UnsafeNameError as exc:
        raise HubError(f"hf.co/{repo_id}/{filename} would not be a file inside the model folder ({exc}); "
                       "nothing was fetched", "name") from None


def part_path(sha256: str, folder: Path | None = None) -> Path:
    """``<models_dir>/.partial/SHA256.part``, where the download of the file with that sha256
    is kept until whole (the folder is created).

    Raises:
        HubError: kind ``"name"``: ``sha256`` is not 64 hex digits.
    """
    if not _SHA256.fullmatch(sha256 or ""):
        raise HubError(f"{sha256!r} is not a sha256; nothing was fetched", "name")
    return inside(partial_dir(folder), f"{sha256}.part")


def manifest_path(path: Path) -> Path:
    """The hidden ``.NAME.json`` beside a downloaded file."""
    return path.with_name(f".{path.name}.json")


def partial_dir(folder: Path | None = None) -> Path:
    """``<models_dir>/.partial`` (created), where downloads in progress are kept."""
    path = (folder or models_dir()) / PARTIAL_DIRNAME
    path.mkdir(parents=True, exist_ok=True)
    return path


def partial_bytes(sha256: str, folder: Path | None = None) -> int:
    """Bytes of the file with that sha256 downloaded so far and kept to resume (0: none)."""
    sha256 = (sha256 or "").lower()
    if not _SHA256.fullmatch(sha256):
        return 0
    try:
        return ((folder or models_dir()) / PARTIAL_DIRNAME / f"{sha256}.part").stat().st_size
    except OSError:
        return 0


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of downloaded file ``path``, or None when missing or unreadable."""
    try:
        data = json.loads(manifest_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(path: Path, data: dict[str, Any]) -> None:
    """Write ``path``'s manifest atomically (a temp name, then a rename).

    Raises:
        OSError: it cannot be written.
    """
    target = manifest_path(path)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class LocalHubFile:
    """A downloaded Hub file.

    Attributes:
        repo_id, filename: where it came from; path: where it is; size_bytes: its size.
        manifest: its manifest (None when missing: the file is listed but its origin unsure).
    """

    repo_id: str
    filename: str
    path: Path
    size_bytes: int
    manifest: dict[str, Any] | None

    @property
    def ref(self) -> str:
        return f"hf.co/{self.repo_id}/{self.filename}"

    @property
    def complete(self) -> bool:
        """Whether its size is the manifest's (a file without one counts as complete)."""
        return self.manifest is None or int(self.manifest.get("size_bytes", -1)) == self.size_bytes


def installed_files(repo_id: str | None = None, folder: Path | None = None) -> list[LocalHubFile]:
    """Every downloaded ``.gguf`` under ``hf.co/`` (of one repo when ``repo_id``), sorted.

    Raises:
        OSError: the model folder cannot be created.
    """
    root = (folder or models_dir()) / HUB_DIRNAME
    if repo_id:
        check_hub_names(repo_id)
    base = root / repo_id if repo_id else root
    out: list[LocalHubFile] = []
    if not base.is_dir():
        return out
    for path in sorted(base.rglob("*.gguf")):
        rel = path.relative_to(root).parts
        if len(rel) < 3 or any(p.startswith(".") for p in rel) or not path.is_file():
            continue
        try:
            size = path.stat().st_size
        except OSError as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        out.append(LocalHubFile(f"{rel[0]}/{rel[1]}", "/".join(rel[2:]), path, size, read_manifest(path)))
    return out


def find_installed(ref: HubRef, preferred: str = "", folder: Path | None = None) -> Path | None:
    """The downloaded file ``ref`` means, chosen among this repo's downloads as the Hub's
    files would be (:func:`~models.hub.ref.choose`), or None: lets a reference work offline
    once fetched. A split model is never installed (attnchat refuses those)."""
    local = [f for f in installed_files(ref.repo_id, folder) if f.complete]
    if not local:
        return None
    ggufs: list[GGUFFile] = group_files([HubFile(f.filename, f.size_bytes) for f in local])
    if not ref.filename and not ref.quant:
        if preferred and any(g.name == preferred for g in ggufs):
            return hub_path(ref.repo_id, preferred, folder)
        # Only some of the repo's files are here: the Hub's "its only file" rule cannot apply.
        ref = replace(ref, quant=DEFAULT_QUANT)
    try:
        chosen = choose(ggufs, ref)
    except RefError:
        return None
    return None if chosen.split else hub_path(ref.repo_id, chosen.name, folder)
