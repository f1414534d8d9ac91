"""A loaded model that no change to its file can reach, and the change said in one line.

A GGUF's weights were views of the file's memory map. When the file is cut short while
mapped (``truncate -s 50M``, a download tool rewriting it in place), the next token reads a
page past the file's new end and the kernel sends SIGBUS: ``serve`` and the desktop died
(exit 135) with nothing in stderr or the log. A private (copy-on-write) map does not help:
truncation unmaps even the pages a process has copied (``unmap_mapping_range``'s
``even_cows``), and a Python SIGBUS handler cannot resume the C loop that faulted. So:

1. :func:`detach`: at load, every weight still a view of the map is read with ``pread``
   into memory of the process's own (the fused q/k/v and gate/up parts already were), and
   the map is dropped: after load nothing of the model file is mapped, and a truncate, a
   rewrite or a delete cannot reach the running model. Memory is the same bytes (the
   blocks, never widened), counted in RSS as when mapped; what is lost is the page cache's
   sharing of them between processes and its dropping of them under memory pressure.
   Blocks a repacked form replaced later are read again with ``pread``, never through a
   map (:mod:`runtime.weights.block_source`): a change then is an error, not SIGBUS.
2. :class:`FileIdentity` records the file (device, inode, size, modification time) at
   load; :func:`check` compares it before each reply, and a change refuses the reply with
   :class:`runtime.errors.ModelFileChanged` ("the model file changed on disk: reload it"),
   shown by the window, answered 503 by the server, exit 2 on the command line; the
   conversation is kept.

Must not import Qt.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import ModelFileChanged, ModelLoadError

__all__ = ["FileIdentity", "check", "detach"]


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one loaded: ``os.stat``'s device, inode, size (bytes)
    and modification time (ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> "FileIdentity":
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check(path: Path, loaded: FileIdentity | None) -> None:
    """Raise :class:`ModelFileChanged` when ``path`` is no longer the file ``loaded`` names
    (removed, replaced, resized, modified); nothing when ``loaded`` is None (a folder).

    Raises:
        ModelFileChanged: one line, what changed.
    """
    if loaded is None:
        return
    try:
        now = FileIdentity.of(path)
    except OSError:
        what = "it is gone"
    else:
        if (now.dev, now.ino) != (loaded.dev, loaded.ino):
            what = "another file is in its place"
        elif now.size != loaded.size:
            what = f"its size went from {loaded.size:,} to {now.size:,} bytes"
        elif now.mtime_ns != loaded.mtime_ns:
            what = "it was modified"
        else:
            return
    raise ModelFileChanged(f"the model file changed on disk: reload it ({Path(path).name}: {what} since it was "
                           "loaded; the model in memory is the one loaded)")


def detach(weights, g) -> int:
    """Replace every block buffer of ``weights`` (a :class:`runtime.weights.gguf.names.GGUFWeights`)
    that is a view of ``g``'s map (:meth:`runtime.weights.gguf.mmap.GGUFTensors.mapped`) by a
    copy read with ``pread``, then drop ``g``'s map. Returns the bytes copied.

    Raises:
        ModelLoadError: the file ended before a tensor's bytes (it changed during the load).
    """
    if g._map is None:
        return 0
    base = g._map.data_ptr()
    end = base + g._map.numel()
    seen: set[int] = set()
    copied = 0
    parts = [w for ws in weights.matrices.values() for w in ws] + [weights.embed] + list(weights.head or [])
    g.release_pages()  # what was read through the map so far (the fused parts' sources) leaves RSS
    with open(g.path, "rb", buffering=0) as f:
        for w in parts:
            if id(w) in seen or not (base <= w.raw.data_ptr() < end):
                continue
            seen.add(id(w))
            buf = torch.empty(w.raw.shape, dtype=torch.uint8)
            got = os.preadv(f.fileno(), [memoryview(buf.numpy()).cast("B")], w.raw.data_ptr() - base)
            if got != buf.numel():
                raise ModelLoadError(f"{Path(g.path).name} ended while it was being loaded (it changed on disk); "
                                     "load it again")
            w.raw = buf
            copied += got
    g.close()
    return copied
