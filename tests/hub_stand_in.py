"""A stand-in Hugging Face Hub for tests: two small HTTP servers on 127.0.0.1 serving the
routes huggingface_hub 2.x really calls, over tiny GGUF files the tests make.

The Hub (``HF_ENDPOINT`` points here):

- ``GET /api/models?search=&filter=gguf&sort=downloads&limit=&expand=...``  (``HfApi.list_models``)
- ``GET /api/models/OWNER/REPO[/revision/REV][?blobs=true]``  (``HfApi.model_info``; with ``blobs``
  every sibling has ``size``, ``blobId`` and ``lfs: {sha256, size, pointerSize}``)
- ``GET /api/models/OWNER/REPO/tree/REV[/PATH][?recursive=true]``  (``HfApi.list_repo_tree``)
- ``HEAD|GET /OWNER/REPO/resolve/REV/PATH``  (``get_hf_file_metadata``, ``http_get``): a 302 to the
  CDN with ``X-Repo-Commit``, ``X-Linked-Etag`` (the LFS sha256), ``X-Linked-Size`` and ``ETag``
  (the pointer's git oid), as huggingface.co answers for an LFS file.

Errors carry the headers huggingface_hub maps to its exceptions: ``X-Error-Code: RepoNotFound``
(404), ``RevisionNotFound``, ``EntryNotFound`` (404 with ``X-Repo-Commit``), ``GatedRepo`` (401
without a token, 403 with one not granted access).

The CDN (another origin, as huggingface.co's is, so the token must not travel there):
``HEAD|GET /blobs/SHA256`` with ``Range`` requests (206 + ``Content-Range``).

Faults a test can set: drop the connection after N bytes of a file's body (for each of
the next GETs), serve other bytes than the listed sha256 says; and lies: list another repo
id, another sha256 or names that are paths (a file's key is its listed name), send a body
with no Content-Length that goes on past the file (:attr:`StandInHub.endless`), announce
more bytes than the file holds (:attr:`StandInHub.longer`), answer a ``Range`` with the
whole file (:attr:`StandInHub.ignore_range`). Every request is recorded
(:attr:`StandInHub.requests`) with its method, path, Range and whether it carried a token.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def gguf_bytes(arch: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2, embd: int = 64,
               context: int = 2048, sliding_window: int = 0, payload: int = 4096, name: str = "tiny",
               seed: int = 0, tokenizer_first: bool = False) -> bytes:
    """A small valid GGUF (v3, no tensors): the shape keys an architecture carries, a tokenizer
    array after them (as llama.cpp's converter writes), then ``payload`` bytes of stand-in data
    (seeded, so two files with different seeds differ)."""
    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    def kv_u32(key: str, v: int) -> bytes:
        return s(key) + struct.pack("<I", 4) + struct.pack("<I", v)

    def kv_str(key: str, v: str) -> bytes:
        return s(key) + struct.pack("<I", 8) + s(v)

    entries = [kv_str("general.architecture", arch), kv_str("general.name", name),
               kv_u32(f"{arch}.block_count", layers), kv_u32(f"{arch}.context_length", context),
               kv_u32(f"{arch}.embedding_length", embd), kv_u32(f"{arch}.attention.head_count", heads),
               kv_u32(f"{arch}.attention.head_count_kv", kv_heads)]
    if sliding_window:
        entries.append(kv_u32(f"{arch}.attention.sliding_window", sliding_window))
    tokens = [f"tok{i}" for i in range(300)]
    tok = s("tokenizer.ggml.tokens") + struct.pack("<I", 9) + struct.pack("<IQ", 8, len(tokens)) + b"".join(map(s, tokens))
    entries = [tok] + entries if tokenizer_first else entries + [tok]
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries)
    body = hashlib.sha256(f"{seed}".encode()).digest() * (payload // 32 + 1)
    return head + body[:payload]


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool | str = False
    license: str = "apache-2.0"
    downloads: int = 0
    likes: int = 0
    architecture: str | None = "llama"
    context_length: int = 2048
    served: dict[str, bytes] = field(default_factory=dict)  # path -> bytes served instead of the listed ones
    lfs: bool = True
    listed_id: str = ""   # the id the listing gives instead of repo_id
    listed_sha: dict[str, str] = field(default_factory=dict)  # path -> the sha256 the listing gives instead

    def sha(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()


@dataclass
class Request:
    server: str          # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    has_token: bool


class StandInHub:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`endpoint` is the Hub's URL."""

    def __init__(self, token: str = "hf_standin_secret_token_0123456789"):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.token = token
        self.granted: set[str] = set()     # gated repos the token may read
        self.drops: dict[str, list[int]] = {}  # sha -> for each coming GET, the body bytes sent before dropping
        self.throttle_s = 0.0   # seconds the CDN waits before each 64 KiB of a body (a slow network)
        self.endless: set[str] = set()     # shas whose body has no Content-Length and goes on past the file
        self.endless_cap = 64 << 20        # bytes an endless body sends at most (so a test cannot hang)
        self.longer: dict[str, int] = {}   # sha -> bytes the Content-Length adds to the file's
        self.ignore_range: set[str] = set()  # shas whose every GET answers 200 with the whole file
        self.sent: dict[str, int] = {}     # sha -> body bytes the CDN wrote for it (all GETs)
        self._servers: list[ThreadingHTTPServer] = []
        self.endpoint = self.cdn = ""

    # ---- content -----------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        repo = Repo(repo_id, dict(files), **kw)
        self.repos[repo_id] = repo
        for path, data in repo.files.items():
            self.blobs[repo.sha(path)] = repo.served.get(path, data)
        return repo

    def drop(self, repo_id: str, path: str, *after_bytes: int) -> None:
        """The next GETs of that file's bytes close the connection after ``after_bytes[i]``
        bytes of the body each (then it is served whole again)."""
        self.drops[self.repos[repo_id].sha(path)] = list(after_bytes)

    def hits(self, server: str | None = None, method: str | None = None, contains: str = "") -> list[Request]:
        return [r for r in self.requests if (server is None or r.server == server)
                and (method is None or r.method == method) and contains in r.path]

    # ---- servers -----------------------------------------------------------------------------
    def start(self) -> "StandInHub":
        hub, cdn = _server(self, "hub"), _server(self, "cdn")
        self._servers = [hub, cdn]
        self.endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
        self.cdn = f"http://127.0.0.1:{cdn.server_address[1]}"
        for srv in self._servers:
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()

    # ---- JSON --------------------------------------------------------------------------------
    def model_json(self, repo: Repo, blobs: bool) -> dict:
        siblings = []
        for path, data in sorted(repo.files.items()):
            sib = {"rfilename": path}
            if blobs:
                sib.update(size=len(data), blobId=hashlib.sha1(b"pointer " + path.encode()).hexdigest())
                if repo.lfs:
                    sib["lfs"] = {"sha256": repo.listed_sha.get(path, repo.sha(path)), "size": len(data),
                                  "pointerSize": 134}
            siblings.append(sib)
        out = {"_id": "x" + repo.repo_id, "id": repo.listed_id or repo.repo_id, "modelId": repo.repo_id,
               "author": repo.repo_id.split("/")[0], "sha": COMMIT, "lastModified": "2025-01-02T03:04:05.000Z",
               "private": False, "disabled": False, "gated": repo.gated, "downloads": repo.downloads,
               "likes": repo.likes, "library_name": "gguf", "tags": ["gguf", f"license:{repo.license}"],
               "cardData": {"license": repo.license}, "siblings": siblings, "createdAt": "2024-01-01T00:00:00.000Z"}
        if repo.architecture:
            out["gguf"] = {"total": 1000, "architecture": repo.architecture, "context_length": repo.context_length}
        return out


def _server(hub: StandInHub, kind: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, data, status: int = 200, headers: dict | None = None) -> None:
            self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
            self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})})

        def _record(self) -> tuple[str, dict]:
            url = urlsplit(self.path)
            auth = self.headers.get("Authorization") or ""
            hub.requests.append(Request(kind, self.command, unquote(url.path), self.headers.get("Range"),
                                        auth == f"Bearer {hub.token}"))
            return unquote(url.path), parse_qs(url.query)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path, query = self._record()
            try:
                (self._cdn if kind == "cdn" else self._hub)(path, query)
            except (BrokenPipeError, ConnectionResetError):
                pass

        # ---- the Hub -------------------------------------------------------------------------
        def _hub(self, path: str, query: dict) -> None:
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) == 2:
                return self._search(query)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = hub.repos.get(f"{parts[2]}/{parts[3]}")
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                rest = parts[4:]
                if not rest or (rest[0] == "revision" and len(rest) == 2):
                    if rest and rest[1] not in ("main", COMMIT):
                        return self._error(404, "RevisionNotFound", "Invalid rev id")
                    return self._json(hub.model_json(repo, "true" in query.get("blobs", [])))
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo, "/".join(rest[2:]))
                return self._error(404, "EntryNotFound", "not found")
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
            for repo in hub.repos.values():  # a listed name with ``..`` in it, as the client normalized it
                for name in repo.files:
                    if posixpath.normpath(f"/{repo.repo_id}/resolve/main/{name}") == path:
                        return self._resolve(repo.repo_id, "main", name)
            return self._error(404, "NotFound", "no such route")

        def _search(self, query: dict) -> None:
            text = (query.get("search") or [""])[0].lower()
            limit = int((query.get("limit") or ["1000"])[0])
            found = [r for r in hub.repos.values() if text in r.repo_id.lower()]
            found.sort(key=lambda r: -r.downloads)
            expand = set(query.get("expand", []) + query.get("expand[]", []))
            out = []
            for r in found[:limit]:
                full = hub.model_json(r, False)
                full.pop("siblings")
                out.append({k: v for k, v in full.items() if not expand or k in expand or k in ("id", "_id")})
            self._json(out)

        def _tree(self, repo: Repo, under: str) -> None:
            out = []
            for path, data in sorted(repo.files.items()):
                if under and not path.startswith(under + "/"):
                    continue
                entry = {"type": "file", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": len(data), "path": path}
                if repo.lfs:
                    entry["lfs"] = {"oid": repo.sha(path), "size": len(data), "pointerSize": 134}
                out.append(entry)
            self._json(out)

        def _resolve(self, repo_id: str, rev: str, path: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if rev not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            auth = self.headers.get("Authorization") or ""
            if repo.gated:
                if not auth:
                    return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                       "access to it and be authenticated to access it. Please log in.")
                if auth != f"Bearer {hub.token}" or repo_id not in hub.granted:
                    return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in "
                                       "the authorized list.")
            if path not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": COMMIT})
            sha = repo.sha(path)
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(path.encode()).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            if repo.lfs:
                headers.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(repo.files[path]),
                                "Location": f"{hub.cdn}/blobs/{sha}?signature=abc"})
                return self._send(302, b"", headers)
            return self._send(200, repo.files[path], headers)

        # ---- the CDN -------------------------------------------------------------------------
        def _cdn(self, path: str, query: dict) -> None:
            parts = path.strip("/").split("/")
            data = hub.blobs.get(parts[-1]) if parts[0] == "blobs" else None
            if data is None:
                return self._send(404, b"NoSuchKey")
            sha, start, end, status = parts[-1], 0, len(data) - 1, 200
            rng = self.headers.get("Range")
            if sha in hub.ignore_range:
                rng = None
            if self.command == "GET" and sha in hub.endless:
                return self._endless(sha, data)
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a or 0), min(int(b) if b else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                status = 206
            body = data[start:end + 1]
            headers = {"ETag": f'"{sha}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            if sha in hub.longer:
                headers["Content-Length"] = str(len(body) + hub.longer[sha])
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command == "GET":
                    self._count(sha, body)
                    self.wfile.flush()
                    time.sleep(2.0)   # then the connection closes short of the announced length
                self.close_connection = True
                return
            drops = hub.drops.get(sha)
            if self.command == "GET" and drops:
                after = drops.pop(0)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self._count(sha, body[:after])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if self.command == "GET" and hub.throttle_s:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 64 << 10):
                    time.sleep(hub.throttle_s)
                    self.wfile.write(body[i:i + (64 << 10)])
                return
            if self.command == "GET":
                hub.sent[sha] = hub.sent.get(sha, 0) + len(body)
            self._send(status, body, headers)

        def _count(self, sha: str, data: bytes) -> None:
            self.wfile.write(data)
            hub.sent[sha] = hub.sent.get(sha, 0) + len(data)

        def _endless(self, sha: str, data: bytes) -> None:
            """The file, then more, with neither a length nor chunked framing: the body ends
            when the connection does (after :attr:`StandInHub.endless_cap` bytes)."""
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            junk = b"\0" * (64 << 10)
            self._count(sha, data)
            while hub.sent[sha] < hub.endless_cap:
                self._count(sha, junk)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    return srv


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running stand-in Hub; HF_ENDPOINT points at it, the model folder is empty, no token
    is set (neither HF_TOKEN nor a saved login), HF_HUB_OFFLINE is unset."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", "")
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("ATTNCHAT_HUB_OFFLINE_BY_APP", raising=False)   # an in-process CLI test may have set it
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # models.hub switches huggingface_hub's telemetry off (it would reach huggingface.co itself):
    # put the flag back after each test.
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", constants.HF_HUB_DISABLE_TELEMETRY)
    # 64 KiB body chunks (1 MiB in use): the tiny files then arrive in several chunks, as big ones do.
    monkeypatch.setattr("models.hub.download.HTTP_CHUNK", 64 << 10)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", constants.DOWNLOAD_CHUNK_SIZE)
    server = StandInHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    yield server
    server.stop()
