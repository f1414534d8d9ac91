"""A lock beside a download's part file that leaves nothing behind.

Two processes fetching the same file take turns on ``<part>.lock``. huggingface_hub's
``WeakFileLock`` (filelock) leaves the lock file in ``.partial/`` after every download. Deleting
it after the release races: a process that opened the file before the delete would lock the
unlinked file while a newcomer locks a new one. So the holder deletes it while it still holds
the lock, and whoever acquires a lock checks that its file is still the one at the path (same
device and inode); if not, it was deleted under it, and it opens the path again (the usual
pattern for self-removing ``flock`` files). Where ``fcntl`` is missing (Windows) filelock's
lock is used as it is (Windows' own lock files go away when closed).

Stdlib only (filelock through huggingface_hub where ``fcntl`` is missing).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:   # Windows
    fcntl = None

__all__ = ["part_lock"]


@contextlib.contextmanager
def part_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created, mode 0o664) for the ``with`` block; the
    file is gone afterwards. Blocks while another process holds it."""
    path = str(path)
    if fcntl is None:
        from huggingface_hub.utils import WeakFileLock

        with WeakFileLock(path):
            yield
        return
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except FileNotFoundError:   # its folder, left empty, was removed by a download that ended
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)   # deleted by the holder before we got it: lock the path's new file
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
