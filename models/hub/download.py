"""Download a GGUF file from the Hugging Face Hub into the model folder: resumable, checked
against the Hub's LFS sha256, moved into place only once whole and checked.

The bytes come over huggingface_hub's HTTP session through :mod:`.transfer` (a resume with
a ``Range`` header after a dropped connection, a bounded number of tries, never a byte past
the listed size), at the revision the repo was listed at (its sha256 must be the listing's),
into ``<models_dir>/.partial/SHA256.part``. ``hf_hub_download`` itself writes a fresh,
process-unique temporary file each time and deletes it on failure, so an interrupted
download would start over; keeping the part under the content's sha256 lets the next
attempt (after Ctrl-C, Cancel, or a lost network) continue where it stopped, and only
into the same bytes. Every name the Hub sends is checked before it becomes a path
(:func:`.local.hub_path`, :func:`.local.part_path`).

What is kept where, per outcome:

- success: ``hf.co/OWNER/REPO/FILE`` and its manifest; the part is gone (renamed).
- cancel, Ctrl-C, lost network: nothing in the model folder; the part stays hidden in
  ``.partial/`` for the next attempt to resume (when the server takes a ``Range``; else
  it is deleted, and the message says which).
- sha256 mismatch, a full disk, a server sending another size than the listing's or more
  bytes: nothing anywhere (the part is deleted: its bytes are wrong, or the disk needs
  the space).
- a name that is not a plain file name (``../``, an absolute path, NUL): refused before
  anything is written.

Two processes fetching the same file take turns (a lock beside the part, :mod:`.part_lock`,
removed when the turn ends).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from models import safety
from models.errors import FetchCancelled, HubError
from models.paths import models_dir
from models.sizes import size_text

from . import api
from .local import find_installed, hub_path, part_path, read_manifest, write_manifest
from .part_lock import part_lock
from .ref import GGUFFile, HubFile, HubRef, parse_ref, choose
from .transfer import Writer, transfer

__all__ = ["fetch_hub", "download_file", "resolve_hub"]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
CancelFn = Callable[[], bool]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
HASH_CHUNK = 1 << 20
HTTP_CHUNK = 1 << 20
"""The body chunk read at a time (huggingface_hub's is 10 MiB, which httpx buffers whole:
Cancel would wait for up to 10 MiB to arrive, progress move in 10 MiB steps, and a dropped
connection lose up to 10 MiB not yet written)."""
DISK_MARGIN_BYTES = 64 << 20
"""Free space kept beyond the file when checking the disk before a download."""


def _hash_file(path: Path, digest=None, limit: int | None = None):
    digest = digest or hashlib.sha256()
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(HASH_CHUNK if left is None else min(HASH_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _check_disk(folder: Path, need: int, name: str) -> None:
    free = _free_bytes(folder)
    if free < need + DISK_MARGIN_BYTES:
        raise HubError(f"not enough disk space for {name}: {size_text(need)} more needed in {folder}, {size_text(free)} free; "
                       "free some space (or set ATTNCHAT_MODELS_DIR to a bigger disk) and try again", "disk_full")


def download_file(repo_id: str, revision: str, file: HubFile, *, progress: ProgressFn | None = None,
                  cancel: CancelFn | None = None, extra: dict[str, Any] | None = None,
                  expected_sha256: str = "") -> Path:
    """Download one file of ``repo_id`` at ``revision`` into the model folder and return its path.

    ``file`` is as the Hub listed it (size, LFS sha256); ``expected_sha256`` is a catalog's
    own checksum, which must agree with the Hub's. ``progress(done, total)`` counts bytes
    (resumed ones included); ``cancel()`` is polled between chunks. ``extra`` goes into the
    manifest (license, architecture).

    Raises:
        FetchCancelled: ``cancel()`` returned True (the part is kept for a resume).
        HubError: no LFS sha256 to check against, the Hub's metadata disagree, the bytes'
            sha256 differs, the disk is full, offline, gated, not found (one line each).
        KeyboardInterrupt: passed on (the part is kept for a resume).
    """
    where = f"hf.co/{repo_id}/{file.path}"
    final = hub_path(repo_id, file.path)
    listed = (file.sha256 or "").lower()
    manifest = read_manifest(final)
    if (listed and final.is_file() and final.stat().st_size == file.size_bytes and manifest
            and manifest.get("sha256") == listed):
        return final
    remote = api.remote_file(repo_id, file.path, revision)
    served = remote.etag.lower() if _SHA256.match(remote.etag.lower()) else ""
    # The LFS sha256: the listing's, else the resolve answer's X-Linked-Etag (the same LFS oid).
    expected = listed or served
    if not expected:
        raise HubError(f"{where} has no LFS sha256 on the Hub to check it against; attnchat fetches only "
                       "files it can check", "checksum")
    if served and served != expected:
        raise HubError(f"the Hub's answers about {where} disagree (listed sha256 {expected[:12]}..., served "
                       f"{served[:12]}...); try again later", "checksum")
    if expected_sha256 and expected_sha256.lower() != expected:
        raise HubError(f"{where} on the Hub (sha256 {expected[:12]}...) is not the file the catalog names "
                       f"({expected_sha256[:12]}...); update attnchat, or fetch it by reference", "checksum")
    size = file.size_bytes or remote.size_bytes or 0
    if not size:
        raise HubError(f"the Hub did not say the size of {where}; try again later", "server")
    if remote.size_bytes is not None and remote.size_bytes != size:
        raise HubError(f"the Hub's answers about {where} disagree (listed {size:,} bytes, served "
                       f"{remote.size_bytes:,}); try again later", "checksum")
    if final.is_file() and final.stat().st_size == size and manifest and manifest.get("sha256") == expected:
        return final
    part = part_path(expected)
    try:
        return _fetch_part(part, final, size, expected, where, repo_id, file, remote, progress, cancel, extra)
    finally:
        # an empty .partial folder is what a failed or finished download left (a kept part or
        # another download's lock keeps it; part_lock makes it again for one that raced this)
        with contextlib.suppress(OSError):
            part.parent.rmdir()


def _fetch_part(part, final, size, expected, where, repo_id, file, remote, progress, cancel, extra) -> Path:
    """The download into ``part`` under its lock, checked and moved to ``final`` (:func:`fetch_file`'s)."""
    folder = models_dir()
    with part_lock(str(part) + ".lock"):
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        _check_disk(folder, size - have, where)
        digest = _hash_file(part) if have else hashlib.sha256()
        if have:
            log.info("resuming %s at %d of %d bytes", where, have, size)
        if progress is not None:
            progress(have, size)
        try:
            with open(part, "ab") as f:
                writer = Writer(f, digest, have, size, progress, cancel, where)
                with api.hub_errors(f"downloading {where}", repo_id, file.path):
                    transfer(remote.url, api._auth_headers(remote.same_host), writer, size, where,
                             chunk=HTTP_CHUNK, new_digest=hashlib.sha256)
                f.flush()
                os.fsync(f.fileno())
        except (FetchCancelled, KeyboardInterrupt):
            kept = part.stat().st_size if part.is_file() else 0
            log.info("download of %s stopped at %d of %d bytes; kept to resume", where, kept, size)
            raise
        except HubError as exc:
            kept = part.stat().st_size if part.is_file() else 0
            if kept and exc.kind in ("offline", "server") and writer.resumable:
                raise HubError(f"{exc}; the {size_text(kept)} of {size_text(size)} downloaded so far are kept: the same "
                               "command resumes", exc.kind) from exc
            if exc.kind == "size" or (kept and exc.kind in ("offline", "server")):
                part.unlink(missing_ok=True)
            if kept and exc.kind in ("offline", "server"):
                raise HubError(f"{exc}; the server does not resume downloads, so the {size_text(kept)} downloaded were "
                               "not kept", exc.kind) from exc
            raise
        except OSError as exc:
            part.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise HubError(f"the disk filled up while downloading {where} ({size_text(size)} in {folder}); nothing "
                               "was kept; free some space and try again", "disk_full") from exc
            raise HubError(f"could not write {where} in {folder} ({' '.join(str(exc.strerror or exc).split())}); "
                           "check the folder's permissions, or set ATTNCHAT_MODELS_DIR", "write") from exc
        got = writer.digest.hexdigest()
        if got != expected:
            part.unlink(missing_ok=True)
            raise HubError(f"checksum mismatch for {where}: the bytes downloaded have sha256 {got[:12]}..., the "
                           f"Hub's LFS metadata say {expected[:12]}...; nothing was kept; try again", "checksum")
        _admit(part, where)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            write_manifest(final, {"repo_id": repo_id, "filename": file.path, "commit": remote.commit,
                                   "sha256": expected, "size_bytes": size, "source": "hf.co",
                                   "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})})
            os.replace(part, final)
        except OSError as exc:
            raise HubError(f"could not move {where} into {final.parent} ({exc.strerror or exc}); check the folder's "
                           "permissions", "write") from exc
        _fsync_dir(final.parent)
    log.info("fetched %s to %s", where, final)
    return final


def _admit(part: Path, where: str) -> None:
    """The rules every load runs (:mod:`models.safety`), on the downloaded bytes before they
    enter the model folder; a refused file is deleted (its sha256 was right: the file on
    the Hub is what is refused, so resuming it would be no use).

    Raises:
        HubError: kind ``"refused"``.
    """
    try:
        safety.check_model(part, name=where)
    except (safety.Refused, OSError) as exc:
        part.unlink(missing_ok=True)
        raise HubError(f"{exc}; it was not kept", "refused") from None


def _check_fetchable(listing: api.RepoListing, gguf: GGUFFile) -> None:
    where = f"hf.co/{listing.repo_id}/{gguf.name}"
    if gguf.split:
        raise HubError(f"{where} is split into {len(gguf.parts)} files; attnchat loads single-file GGUFs only: "
                       f"pick another quant (`attnchat models files hf.co/{listing.repo_id}`), or merge the parts with "
                       "llama.cpp's `llama-gguf-split --merge` and `attnchat models import` the result", "split")
    if listing.supported is False:
        from .gguf_meta import SUPPORTED_ARCHITECTURES

        raise HubError(f"hf.co/{listing.repo_id} is a {listing.architecture!r} model, which attnchat's decoder does "
                       f"not run (it runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}); pick another model",
                       "unsupported")


def fetch_hub(ref: str | HubRef, *, progress: ProgressFn | None = None, cancel: CancelFn | None = None,
              preferred: str = "", expected_sha256: str = "") -> Path:
    """Fetch the GGUF file ``ref`` names (see :mod:`models.hub.ref`) and return its path;
    a file already downloaded whole is returned without downloading again.

    ``preferred`` is the file a reference without a tag gets (the catalog's).

    Raises:
        HubError: a bad reference, nothing matching, a split model, an architecture attnchat
            does not run, and everything :func:`download_file` raises.
        FetchCancelled, KeyboardInterrupt: see :func:`download_file`.
    """
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    listing = api.repo_listing(ref.repo_id, ref.revision)
    gguf = choose(listing.ggufs, ref, preferred)
    _check_fetchable(listing, gguf)
    extra = {"license": listing.license, "gated": listing.gated or False, "architecture": listing.architecture,
             "quant": gguf.quant, "revision": ref.revision}
    return download_file(listing.repo_id, listing.revision, gguf.parts[0], progress=progress, cancel=cancel,
                         extra=extra, expected_sha256=expected_sha256)


def resolve_hub(ref: str | HubRef, *, progress: ProgressFn | None = None, cancel: CancelFn | None = None,
                preferred: str = "") -> Path:
    """The local file for ``ref``: the downloaded one when there (no network), else fetched.

    Raises:
        see :func:`fetch_hub`.
    """
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    return find_installed(ref, preferred) or fetch_hub(ref, progress=progress, cancel=cancel, preferred=preferred)
