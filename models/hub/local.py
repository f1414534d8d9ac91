"""Where Hub downloads live in the model folder, and what is there. Stdlib only.

A file ``FILE`` of repo ``OWNER/REPO`` is kept as ``<models_dir>/hf.co/OWNER/REPO/FILE`` (the
reference's own shape, so two repos' ``model-Q4_K_M.gguf`` never collide), beside a hidden
``.FILE.json`` saying where it came from (repo, commit, sha256, size, license). A download
in progress is ``<models_dir>/.partial/SHA256.part``: hidden, never a model, named by the
content it will hold so an interrupted download resumes only into the same bytes.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.paths import models_dir

from .ref import DEFAULT_QUANT, GGUFFile, HubFile, HubRef, RefError, choose, group_files

__all__ = ["HUB_DIRNAME", "LocalHubFile", "find_installed", "hub_path", "installed_files", "manifest_path",
           "partial_bytes", "partial_dir", "read_manifest", "write_manifest"]

log = logging.getLogger(__name__)

HUB_DIRNAME = "hf.co"
PARTIAL_DIRNAME = ".partial"


def hub_path(repo_id: str, filename: str, folder: Path | None = None) -> Path:
    """``<models_dir>/hf.co/OWNER/REPO/FILENAME`` (no folder is created but the model folder)."""
    owner, repo = repo_id.split("/", 1)
    return (folder or models_dir()) / HUB_DIRNAME / owner / repo / Path(*filename.split("/"))


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
    if not sha256:
        return 0
    try:
        return ((folder or models_dir()) / PARTIAL_DIRNAME / f"{sha256.lower()}.part").stat().st_size
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
