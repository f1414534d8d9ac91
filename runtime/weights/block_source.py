"""Where a matrix's blocks lie in its GGUF file, and reading them back from there.
Must not import Qt or runtime.kernels.

Why: a weight whose blocks another form replaces in memory (ggml's repacked forms,
:mod:`runtime.kernels.ggml_repack`) lets them go (:meth:`runtime.weights.quant_weight.QuantWeight.drop_blocks`),
so the model takes the form's bytes instead of the form's and the blocks'. What still reads
the blocks after that (the ``widen`` prefill kernel, a widened matrix for the attribution
view, a repack made later) reads them again from the file with ``pread``: one descriptor
per file, opened on the first such read and checked against the file as it was when the
weights were read. Not through a memory map: a file cut short while loaded then gives a
short read and :class:`runtime.errors.ModelFileChanged`, never SIGBUS
(:mod:`runtime.weights.file_guard`); a file replaced or deleted after the descriptor opened
is still read as it was (the descriptor holds the old inode).
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.errors import ModelFileChanged
from runtime.weights.file_guard import FileIdentity

__all__ = ["BlockSource", "ModelFile", "Segment"]


class ModelFile:
    """A GGUF file as read at load (``identity``: :meth:`FileIdentity.of` then), read again
    with ``pread`` through one descriptor opened on first use and closed with this object."""

    def __init__(self, path: str | Path, identity: FileIdentity | None = None):
        self.path = Path(path)
        self.identity = identity if identity is not None else FileIdentity.of(self.path)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _changed(self, what: str) -> ModelFileChanged:
        return ModelFileChanged(f"the model file changed on disk: reload it ({self.path.name}: {what} since it was "
                                "loaded, and its blocks are read from it again)")

    def _descriptor(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    fd = os.open(self.path, os.O_RDONLY)
                except OSError:
                    raise self._changed("it is gone") from None
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (self.identity.dev, self.identity.ino):
                    os.close(fd)
                    raise self._changed("another file is in its place")
                self._fd = fd
                weakref.finalize(self, os.close, fd)
            return self._fd

    def pread_into(self, buf: torch.Tensor, offset: int) -> None:
        """Fill the contiguous ``uint8`` ``buf`` with the file's bytes from ``offset``.

        Raises:
            ModelFileChanged: the file is gone, replaced before the first read, or its size or
                modification time differs from the load's (a short read is one such change).
        """
        fd = self._descriptor()
        st = os.fstat(fd)
        if st.st_size != self.identity.size or st.st_mtime_ns != self.identity.mtime_ns:
            raise self._changed(f"its size or modification time changed ({self.identity.size:,} -> {st.st_size:,} bytes)")
        got = os.preadv(fd, [memoryview(buf.numpy()).cast("B")], offset)
        if got != buf.numel():
            raise self._changed(f"it ended {offset + got:,} bytes in, before a weight's blocks")


@dataclass(frozen=True)
class Segment:
    """Rows of one GGUF tensor: ``rows`` rows from the absolute byte ``offset``; ``perm``: row
    ``n`` of the segment is the file's row ``perm[n]`` (int64 ``(rows,)``; None: in order)."""

    offset: int
    rows: int
    perm: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockSource:
    """A matrix's blocks in ``file``: ``segments`` stacked along the rows (a fused q/k/v is
    three), each row ``row_bytes`` bytes."""

    file: ModelFile
    row_bytes: int
    segments: tuple[Segment, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    def read(self, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` as ``uint8 (stop - start, row_bytes)``, into ``out`` when given
        (contiguous, at least that many bytes).

        Raises:
            ModelFileChanged: as :meth:`ModelFile.pread_into`.
            ValueError: rows outside the matrix.
        """
        stop = self.rows if stop is None else stop
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"rows {start}:{stop} of a {self.rows}-row matrix")
        n = stop - start
        if out is None:
            out = torch.empty(n, self.row_bytes, dtype=torch.uint8)
        else:
            out = out.reshape(-1)[: n * self.row_bytes].view(n, self.row_bytes)
        r0 = 0
        for s in self.segments:   # the part of [start, stop) in each segment
            a, b = max(start, r0), min(stop, r0 + s.rows)
            if a < b:
                dst = out[a - start : b - start]
                if s.perm is None:
                    self.file.pread_into(dst, s.offset + (a - r0) * self.row_bytes)
                else:   # the file rows these come from lie in one span: read it, then reorder
                    idx = s.perm[a - r0 : b - r0].numpy()
                    lo, hi = int(idx.min()), int(idx.max()) + 1
                    span = torch.empty(hi - lo, self.row_bytes, dtype=torch.uint8)
                    self.file.pread_into(span, s.offset + lo * self.row_bytes)
                    dst.numpy()[:] = np.take(span.numpy(), idx - lo, axis=0)
            r0 += s.rows
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``(n,)``) as ``uint8 (n, row_bytes)``, one read a row.

        Raises:
            ModelFileChanged: as :meth:`ModelFile.pread_into`.
        """
        out = torch.empty(ids.numel(), self.row_bytes, dtype=torch.uint8)
        for i, r in enumerate(ids.tolist()):
            self.read(r, r + 1, out[i])
        return out
