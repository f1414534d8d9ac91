"""One file's bytes from the Hub into its part file: never more than the listing says, and
a bounded number of tries. Stdlib here; huggingface_hub's HTTP session inside the function.

huggingface_hub's ``http_get`` trusts the server: it writes whatever the body holds (a body
without a Content-Length that never ends grew a part to 5.9 GB in 60 s), and it starts its
five retries over whenever a byte arrives, so a server that sends a little and drops, or
answers every ``Range`` with the whole file, keeps it resuming until killed. Here, over the
same session (its proxies, SSL settings and hooks):

1. the answer's ``Content-Length`` and ``Content-Range`` must agree with the listed size
   (else :class:`~models.errors.HubError` kind ``"size"``);
2. the body is written up to the listed size; one byte past it is refused (kind ``"size"``:
   the caller deletes the part);
3. a broken connection, a timeout, or a body that ends early is tried again (``Range`` from
   the bytes kept) after :data:`RETRY_WAIT_S`, at most :data:`RETRIES` times in a row
   without a byte the part did not hold before, and :data:`MAX_ATTEMPTS` requests in all;
   then the last error is raised (the caller's ``hub_errors`` makes it one line);
4. a server that answers a ``Range`` with the whole file (200) starts the part over, and
   counts as no progress.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

from models.errors import FetchCancelled, HubError

__all__ = ["MAX_ATTEMPTS", "RETRIES", "RETRY_WAIT_S", "Writer", "transfer"]

log = logging.getLogger(__name__)

RETRIES = 5
"""Tries in a row that bring no new byte before a download gives up (huggingface_hub's count)."""
MAX_ATTEMPTS = 20
"""Requests one download makes at most, whatever each brought."""
RETRY_WAIT_S = 1.0
"""Seconds between tries (huggingface_hub's wait)."""
READ_TIMEOUT_S = 10.0
"""Seconds without a byte before a try counts as broken (huggingface_hub's download timeout)."""

ProgressFn = Callable[[int, int], None]
CancelFn = Callable[[], bool]
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", re.IGNORECASE)


class Writer:
    """The part file a download writes into: hashes as it goes, reports progress
    (``progress(done, total)``, bytes), and raises :class:`FetchCancelled` from :meth:`write`
    when ``cancel()`` says stop. ``resumable``: whether the server's last answer took a
    ``Range`` (206, or ``Accept-Ranges: bytes``)."""

    def __init__(self, f, digest, done: int, total: int, progress: ProgressFn | None,
                 cancel: CancelFn | None, name: str):
        self.f, self.digest, self.done, self.total = f, digest, done, total
        self.progress, self.cancel, self.name = progress, cancel, name
        self.resumable = True

    def write(self, data: bytes) -> None:
        if self.cancel is not None and self.cancel():
            raise FetchCancelled(f"fetching {self.name} was cancelled")
        self.f.write(data)
        self.digest.update(data)
        self.done += len(data)
        if self.progress is not None:
            self.progress(self.done, self.total)

    def restart(self, digest) -> None:
        """Empty the part (the server sent the file from its first byte)."""
        self.f.seek(0)
        self.f.truncate()
        self.digest, self.done = digest, 0


def _refuse(where: str, size: int, what: str) -> HubError:
    return HubError(f"the Hub's answers about {where} disagree (listed {size:,} bytes; {what}); nothing was kept; "
                    "try again later", "size")


def _attempt(url: str, headers: dict[str, str], w: Writer, size: int, where: str, chunk: int, new_digest) -> None:
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    have = w.done
    ask = {**headers, "Accept-Encoding": "identity"}
    if have:
        ask["Range"] = f"bytes={have}-"
    with get_session().stream("GET", url, headers=ask, timeout=READ_TIMEOUT_S) as r:
        hf_raise_for_status(r)
        # A 200 to a Range is a server that does not resume (or says so and does not).
        w.resumable = r.status_code == 206 or (not have and r.headers.get("accept-ranges", "").strip().lower() == "bytes")
        start = 0
        if r.status_code == 206:
            m = _CONTENT_RANGE.fullmatch(r.headers.get("content-range", "").strip())
            if m is None or int(m.group(1)) != have or (m.group(3) != "*" and int(m.group(3)) != size):
                raise _refuse(where, size, f"a resume from byte {have:,} answered "
                                           f"{r.headers.get('content-range', 'no Content-Range')!r}")
            start = have
        elif have:
            w.restart(new_digest())
        length = r.headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) != size - start):
            raise _refuse(where, size, f"the download announced {length} bytes from byte {start:,}")
        for data in r.iter_bytes(chunk):
            room = size - w.done
            if len(data) > room:
                if room:
                    w.write(data[:room])
                raise HubError(f"the Hub sent more than the {size:,} bytes its listing gives for {where}; the "
                               "download was cut there and nothing was kept; try again later", "size")
            w.write(data)
    if w.done < size:
        raise httpx2.RemoteProtocolError(f"the body ended at byte {w.done:,} of {size:,}")


def transfer(url: str, headers: dict[str, Any], w: Writer, size: int, where: str, *, chunk: int, new_digest) -> None:
    """Bring ``w`` from ``w.done`` to ``size`` bytes from ``url`` (see the module docstring).
    ``chunk``: bytes read at a time; ``new_digest()``: an empty hash for a restart.

    Raises:
        HubError: kind ``"size"`` (a size that disagrees with the listing, a body past it).
        httpx2.TransportError: the connection failed :data:`RETRIES` times in a row without
            a new byte, or :data:`MAX_ATTEMPTS` requests were made.
        FetchCancelled: ``cancel()`` said stop. huggingface_hub's HTTP errors (4xx, 5xx).
    """
    import httpx2

    attempts = idle = 0
    furthest = w.done
    while True:
        attempts += 1
        try:
            _attempt(url, headers, w, size, where, chunk, new_digest)
            return
        except (httpx2.TransportError, httpx2.StreamError) as exc:
            if w.done > furthest:
                furthest, idle = w.done, 0
            else:
                idle += 1
            if idle >= RETRIES or attempts >= MAX_ATTEMPTS:
                log.info("giving up on %s after %d requests (%d in a row without a new byte): %r",
                         where, attempts, idle, exc)
                raise
            log.info("%s: %r at byte %d of %d; resuming", where, exc, w.done, size)
            time.sleep(RETRY_WAIT_S)
