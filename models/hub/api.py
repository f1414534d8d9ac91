"""Asking the Hugging Face Hub: search GGUF repos, list a repo's GGUF files, read a file's
model shape; every failure turned into one :class:`~models.errors.HubError` line.

Everything goes through ``huggingface_hub`` (``HfApi``, ``get_hf_file_metadata``, its HTTP
session), imported when first needed so ``import models`` stays cheap. The endpoint is
``HF_ENDPOINT`` read at each call (the tests point it at a local stand-in Hub after
``huggingface_hub`` is imported); the token is the user's own, from huggingface_hub's
login (``hf auth login``) or ``HF_TOKEN``, never passed through attnchat's code, printed
or logged. A user's ``HF_HUB_OFFLINE=1`` is honoured before any request; the one attnchat sets
for its libraries (:func:`libraries_offline`) is not.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from models.errors import HubError

from .gguf_meta import SUPPORTED_ARCHITECTURES, GGUFMetaError, GGUFShape, read_shape
from .local import check_hub_names, checked_files
from .ref import GGUFFile, HubFile, group_files

__all__ = ["APP_OFFLINE_ENV", "RemoteFile", "RepoHit", "RepoListing", "endpoint", "hub_errors", "libraries_offline",
           "offline", "remote_file",
           "repo_listing", "remote_shape", "search"]

log = logging.getLogger(__name__)

LIBRARY = "attnchat"
SEARCH_LIMIT = 30
"""Repos a search returns at most."""
REQUEST_TIMEOUT_S = 15.0
"""Seconds to wait for the Hub's answer to one search."""
_OFFLINE_HINT = "or use a model you already have (`attnchat models list`, `attnchat models import PATH`)"


def endpoint() -> str:
    """The Hub's address: ``$HF_ENDPOINT`` now, else huggingface_hub's (https://huggingface.co)."""
    value = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    if value:
        return value
    from huggingface_hub import constants

    return constants.ENDPOINT


APP_OFFLINE_ENV = "ATTNCHAT_HUB_OFFLINE_BY_APP"
"""Set to "1" by :func:`libraries_offline` when attnchat, not the user, switched the hubs off."""
_TRUE = {"1", "ON", "YES", "TRUE"}
_reach_lock = threading.Lock()
_reach_users = 0
_reach_saved: bool | None = None


def libraries_offline() -> None:
    """Switch huggingface_hub and transformers offline for the app's own model loading (a local
    file never needs a hub, and a library reaching for one would hang without network), unless
    the user set ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` already; and huggingface_hub's
    telemetry off (``HF_HUB_DISABLE_TELEMETRY``, unless set). Call it before transformers
    or huggingface_hub is imported (the command line's and the frozen app's entry points do).
    The explicit requests of this module still go out (:func:`_reachable`); a user's own
    ``HF_HUB_OFFLINE=1`` stops them too."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if os.environ.get("HF_HUB_OFFLINE", "").strip() or os.environ.get("TRANSFORMERS_OFFLINE", "").strip():
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ[APP_OFFLINE_ENV] = "1"


def _app_switched_off() -> bool:
    return os.environ.get(APP_OFFLINE_ENV) == "1"


def offline() -> bool:
    """Whether the user said not to use the network (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``,
    unless :func:`libraries_offline` set them)."""
    if _app_switched_off():
        return False
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if flag.strip().upper() in _TRUE:
        return True
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _no_telemetry() -> None:
    """Nothing but the request asked for: huggingface_hub's telemetry (its user agent names the
    torch version and, to do so, fetches an "agent harnesses" list from the Hub once a day) is
    off, unless the user set ``HF_HUB_DISABLE_TELEMETRY`` themselves."""
    if not os.environ.get("HF_HUB_DISABLE_TELEMETRY", "").strip():
        from huggingface_hub import constants

        constants.HF_HUB_DISABLE_TELEMETRY = True


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Let huggingface_hub's requests out while inside, when only attnchat switched it offline
    (its request hook reads ``constants.HF_HUB_OFFLINE``, fixed at import). Nested and
    concurrent uses share one switch; the last to leave restores it."""
    global _reach_users, _reach_saved
    if not _app_switched_off():
        yield
        return
    from huggingface_hub import constants

    with _reach_lock:
        if _reach_users == 0:
            _reach_saved = constants.HF_HUB_OFFLINE
            constants.HF_HUB_OFFLINE = False
        _reach_users += 1
    try:
        yield
    finally:
        with _reach_lock:
            _reach_users -= 1
            if _reach_users == 0:
                constants.HF_HUB_OFFLINE = bool(_reach_saved)


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), library_name=LIBRARY)


def _page(repo_id: str) -> str:
    return f"{endpoint()}/{repo_id}"


@contextlib.contextmanager
def hub_errors(what: str, repo_id: str = "", filename: str = "") -> Iterator[None]:
    """Turn huggingface_hub's and httpx's exceptions inside into one-line :class:`HubError`\\ s.

    ``what`` names the action (``"searching the Hub"``); the messages never hold a token or
    a request's headers (huggingface_hub's own messages, which carry request ids and URLs,
    go to the log at debug level).
    """
    if offline():
        raise HubError(f"{what}: the Hugging Face Hub is switched off here (HF_HUB_OFFLINE is set); unset it to "
                       f"search or download, {_OFFLINE_HINT}", "offline")
    import httpx2
    from huggingface_hub import errors as hf
    from huggingface_hub.utils import OfflineModeIsEnabled

    where = f"hf.co/{repo_id}" if repo_id else "the Hub"
    _no_telemetry()
    try:
        with _reachable():
            yield
    except HubError:
        raise
    except OfflineModeIsEnabled as exc:
        raise HubError(f"{what}: the Hugging Face Hub is switched off here (HF_HUB_OFFLINE); {_OFFLINE_HINT}",
                       "offline") from exc
    except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.ProxyError) as exc:
        log.debug("%s: %r", what, exc)
        raise HubError(f"{what}: cannot reach the Hugging Face Hub at {endpoint()} ({type(exc).__name__}); "
                       f"check the network connection, {_OFFLINE_HINT}", "offline") from exc
    except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as exc:
        log.debug("%s: %r", what, exc)
        raise HubError(f"{what}: the connection to the Hugging Face Hub broke ({type(exc).__name__}); check the "
                       "network connection and try again", "offline") from exc
    except hf.GatedRepoError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status == 403:
            raise HubError(f"{what}: {where} is gated and this Hugging Face account has no access yet; accept its "
                           f"terms at {_page(repo_id)} (some need the authors' approval) and try again", "gated") from exc
        raise HubError(f"{what}: {where} is gated: accept its terms at {_page(repo_id)}, then log in with "
                       "`hf auth login` (attnchat uses huggingface_hub's saved token)", "gated") from exc
    except hf.RevisionNotFoundError as exc:
        raise HubError(f"{what}: {where} has no such revision; use its main branch", "not_found") from exc
    except hf.RemoteEntryNotFoundError as exc:
        name = f" {filename!r}" if filename else " such file"
        raise HubError(f"{what}: {where} has no file{name}; `attnchat models files hf.co/{repo_id}` lists its "
                       "GGUF files", "not_found") from exc
    except hf.RepositoryNotFoundError as exc:
        raise HubError(f"{what}: {where}: no such model repo on the Hub (or it is private); check the name with "
                       "`attnchat models search TEXT`, or log in with `hf auth login` if it is yours", "not_found") from exc
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        log.debug("%s: %s", what, exc)
        if status == 401:
            raise HubError(f"{what}: the Hub refused the saved Hugging Face token (invalid or expired); log in "
                           "again with `hf auth login`, or unset HF_TOKEN", "auth") from exc
        if status == 404:
            raise HubError(f"{what}: {where}: not found on the Hub", "not_found") from exc
        raise HubError(f"{what}: the Hugging Face Hub answered HTTP {status or '?'}; try again later",
                       "server") from exc
    except (httpx2.HTTPError, ValueError, KeyError, TypeError) as exc:
        # A malformed answer (a proxy's HTML page instead of JSON, a missing field).
        log.warning("%s: %r", what, exc, exc_info=True)
        raise HubError(f"{what}: the answer from {endpoint()} was not what the Hub sends ({type(exc).__name__}); "
                       "check HF_ENDPOINT and any proxy, then try again", "server") from exc


def _license(card: Any, tags: list[str] | None) -> str:
    lic = getattr(card, "license", None) if card is not None else None
    if isinstance(lic, list):
        lic = ", ".join(map(str, lic))
    if lic and lic != "other":
        return str(lic)
    name = getattr(card, "license_name", None) if card is not None else None
    if name:
        return str(name)
    for tag in tags or ():
        if tag.startswith("license:"):
            return tag.split(":", 1)[1]
    return str(lic or "")


@dataclass(frozen=True)
class RepoHit:
    """One search result: a GGUF repo.

    Attributes:
        repo_id: ``OWNER/REPO``; ``ref`` the reference to fetch it with.
        downloads: downloads over the last 30 days; likes: its likes.
        gated: False, ``"auto"`` or ``"manual"`` (terms to accept before downloading).
        license: the card's license ("" when not said).
        architecture: the GGUF architecture the Hub read from its files ("" when not known);
        supported: whether attnchat runs it (None when not known).
        context_length: tokens (0 when not known); parameters: its count (0 when not known).
        last_modified: ISO date of its last commit ("" when not known).
    """

    repo_id: str
    downloads: int
    likes: int
    gated: Any
    license: str
    architecture: str
    supported: bool | None
    context_length: int
    parameters: int
    last_modified: str

    @property
    def ref(self) -> str:
        return f"hf.co/{self.repo_id}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ref": self.ref}


def _gguf_facts(gguf: dict | None) -> tuple[str, bool | None, int, int]:
    gguf = gguf or {}
    arch = str(gguf.get("architecture") or "")
    return (arch, (arch in SUPPORTED_ARCHITECTURES) if arch else None,
            int(gguf.get("context_length") or 0), int(gguf.get("total") or 0))


def search(text: str, limit: int = SEARCH_LIMIT) -> list[RepoHit]:
    """GGUF model repos whose name holds ``text``, most downloaded first.

    Raises:
        HubError: offline, or the Hub failed (one line).
    """
    from huggingface_hub import ModelInfo
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    with hub_errors(f"searching the Hub for {text!r}"):
        # HfApi.list_models's route and parameters, as one request: its pager retries a refused
        # connection five times with back-off (23 s before saying the network is down).
        params: dict[str, Any] = {"filter": "gguf", "sort": "downloads", "limit": max(1, limit),
                                  "expand": ["downloads", "likes", "gated", "tags", "lastModified", "gguf", "cardData"]}
        if text.strip():
            params["search"] = text.strip()
        r = get_session().get(f"{endpoint()}/api/models", params=params, timeout=REQUEST_TIMEOUT_S,
                              headers=build_hf_headers(library_name=LIBRARY))
        hf_raise_for_status(r)
        items = [ModelInfo(**{"siblings": None, **item}) for item in r.json()]
        hits = []
        for m in items:
            arch, supported, ctx, params = _gguf_facts(m.gguf)
            hits.append(RepoHit(
                repo_id=m.id, downloads=int(m.downloads or 0), likes=int(m.likes or 0), gated=m.gated or False,
                license=_license(m.card_data, m.tags), architecture=arch, supported=supported,
                context_length=ctx, parameters=params,
                last_modified=m.last_modified.date().isoformat() if m.last_modified else ""))
    return sorted(hits, key=lambda h: -h.downloads)


@dataclass(frozen=True)
class RepoListing:
    """A repo's GGUF models at one commit.

    Attributes:
        repo_id: ``OWNER/REPO``; commit: the commit listed ("" when the answer had none);
            revision: the revision asked
            for (downloads resolve files at it; their sha256 must be the listing's, so a
            push in between is caught).
        ggufs: its GGUF models (split ones grouped), smallest first.
        gated, license, architecture, supported, context_length, parameters: as in
            :class:`RepoHit`.
    """

    repo_id: str
    commit: str
    ggufs: list[GGUFFile]
    revision: str = "main"
    gated: Any = False
    license: str = ""
    architecture: str = ""
    supported: bool | None = None
    context_length: int = 0
    parameters: int = 0
    files: list[HubFile] = field(default_factory=list)


def repo_listing(repo_id: str, revision: str = "main") -> RepoListing:
    """``repo_id``'s files with sizes and LFS sha256s (one ``model_info`` call with files
    metadata), its GGUF models grouped, and what the Hub says of it.

    Raises:
        HubError: offline, no such repo or revision, or the Hub failed.
    """
    with hub_errors(f"listing hf.co/{repo_id}", repo_id):
        api = _api()
        info = api.model_info(repo_id, revision=None if revision == "main" else revision, files_metadata=True,
                              timeout=REQUEST_TIMEOUT_S)
        files = [HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                         (s.lfs.sha256 if s.lfs else "") or "") for s in (info.siblings or [])]
        arch, supported, ctx, params = _gguf_facts(info.gguf)
        if any(f.path.lower().endswith(".gguf") and not (f.size_bytes and f.sha256) for f in files):
            # An answer without files metadata: the tree at that commit has sizes and LFS oids.
            tree = api.list_repo_tree(repo_id, revision=info.sha or revision, recursive=True)
            files = [HubFile(t.path, int(t.size or 0), (t.lfs.sha256 if t.lfs else "") or "")
                     for t in tree if hasattr(t, "size")]
        listed_id = info.id or repo_id
        check_hub_names(listed_id)
        files = checked_files(listed_id, files)
        return RepoListing(
            repo_id=listed_id, commit=info.sha or "", ggufs=group_files(files), revision=revision,
            gated=info.gated or False,
            license=_license(info.card_data, info.tags), architecture=arch, supported=supported,
            context_length=ctx, parameters=params, files=files)


@dataclass(frozen=True)
class RemoteFile:
    """Where a file's bytes are, from a HEAD on its ``resolve`` address.

    Attributes:
        url: the address to GET (the CDN's, after the Hub's redirect).
        same_host: whether ``url`` is on the Hub itself (the token may go there; never elsewhere).
        etag: the linked ETag: the LFS sha256 for a file in LFS.
        size_bytes: its size (None when the Hub did not say); commit: the commit it resolved at.
    """

    url: str
    same_host: bool
    etag: str
    size_bytes: int | None
    commit: str


def remote_file(repo_id: str, filename: str, revision: str) -> RemoteFile:
    """HEAD ``resolve/REVISION/FILENAME`` (with the user's token, if any).

    Raises:
        HubError: offline, gated, no such file, or the Hub failed.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    with hub_errors(f"fetching hf.co/{repo_id}/{filename}", repo_id, filename):
        url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint())
        meta = get_hf_file_metadata(url, library_name=LIBRARY, endpoint=endpoint())
        if not meta.commit_hash or not meta.etag:
            raise ValueError("no X-Repo-Commit or ETag header on the resolve answer")
        return RemoteFile(url=meta.location, same_host=_origin(url) == _origin(meta.location),
                          etag=meta.etag, size_bytes=meta.size, commit=meta.commit_hash)


def _origin(url: str) -> tuple[str, str, int | None]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return u.scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme)


def _auth_headers(same_host: bool) -> dict[str, str]:
    """huggingface_hub's headers; the token only for the Hub itself, never a CDN's address."""
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(library_name=LIBRARY)
    if not same_host:
        headers.pop("authorization", None)
    return headers


def remote_shape(repo_id: str, gguf: GGUFFile, revision: str) -> GGUFShape:
    """The model shape in the first kilobytes of ``gguf``'s first file (ranged GETs).

    Raises:
        HubError: offline, gated, not found, the Hub failed, or the start of the file is not
            a GGUF header with a shape (kind ``"server"``).
    """
    from huggingface_hub.utils import get_session, hf_raise_for_status

    first = gguf.parts[0].path
    where = remote_file(repo_id, first, revision)
    headers = _auth_headers(where.same_host)

    def read_at(offset: int, length: int) -> bytes:
        out = bytearray()
        rng = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}
        with get_session().stream("GET", where.url, headers={**headers, **rng}, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code == 416:
                return b""
            hf_raise_for_status(r)
            skip = offset if r.status_code == 200 else 0  # a server that ignores Range sends from byte 0
            for chunk in r.iter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                out += chunk
                if len(out) >= length:
                    break
        return bytes(out[:length])

    with hub_errors(f"reading the header of hf.co/{repo_id}/{first}", repo_id, first):
        try:
            return read_shape(read_at)
        except GGUFMetaError as exc:
            raise HubError(f"hf.co/{repo_id}/{first} does not start with a GGUF header attnchat can read ({exc})",
                           "server") from exc
