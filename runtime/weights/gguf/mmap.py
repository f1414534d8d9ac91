"""A GGUF file's tensors as memory-mapped raw blocks: names, block types, shapes and byte
ranges, read without dequantizing anything. Must not import Qt or transformers.

Why not ``gguf.GGUFReader``: it turns every element of every metadata array into numpy
views before it lists a single tensor. Measured on the Intel Xeon (2 cores, busy):
22 s and 198 MB for the default model (49,152-token vocabulary), 79 s and 726 MB for
Gemma 3 270M (262,144 tokens), the time of a first reply many times over. This reader
walks the header with :mod:`models.safety.gguf_scan`'s metadata reader (the same limits and scalar table,
refusing the same oversized files), keeps the scalar metadata and the tensor table, and
maps the data region once: a tensor is a ``uint8`` view of the file's pages, read from
disk only when a product touches it (as llama.cpp's mmap). The tests check it against
``GGUFReader`` on generated files.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, version 2 and 3):
header, metadata, then per tensor: name (string), n_dims u32, ne u64 x n_dims (ggml
order: the row length first), type u32, offset u64 (from the data region's start);
the data region begins at the next multiple of ``general.alignment`` (default 32).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.safety.gguf_scan import (
    ARRAY, SCALAR_BYTES, SCALAR_FORMATS, STRING, GGUFHeaderError, HeaderStats, MetadataReader,
)

#: Strings kept as metadata values up to this many bytes (a chat template is tens of KB;
#: longer ones are skipped and recorded as their length).
MAX_KEPT_STRING = 1 << 18
#: At most this many dimensions per tensor (ggml's GGML_MAX_DIMS).
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        ggml_type: the block type's id (``gguf.GGMLQuantizationType``).
        shape: torch order, the row length last (``(out, in)`` for a matrix; ggml's ``ne`` reversed).
        offset: absolute byte offset of the first block in the file.
        nbytes: bytes of the tensor's blocks.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class GGUFTensors:
    """What :func:`read_gguf_tensors` read: metadata (scalars and short strings; arrays as
    ``("array", item type, count)``), the tensor table in file order, and the data region."""

    path: Path
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]
    _map: torch.Tensor | None = field(default=None, repr=False)
    _memmap: np.memmap | None = field(default=None, repr=False)  # what _map views (its mmap: release_pages)

    def mapped(self) -> torch.Tensor:
        """The whole file as a ``uint8`` tensor over a private (copy-on-write) memory map:
        its pages are the file's, read on first touch, never copied unless written."""
        if self._map is None:
            arr = np.memmap(self.path, dtype=np.uint8, mode="c")  # MAP_PRIVATE: writable, file-backed
            self._map, self._memmap = torch.from_numpy(arr), arr
        return self._map

    def raw(self, name: str) -> torch.Tensor:
        """``name``'s blocks, ``uint8 (rows, bytes per row)`` (a 1-D tensor: ``(1, bytes)``),
        a view of :meth:`mapped`.

        Raises:
            KeyError: no such tensor.
        """
        info = self.tensors[name]
        rows = 1
        for d in info.shape[:-1]:
            rows *= d
        return self.mapped()[info.offset : info.offset + info.nbytes].view(rows, info.nbytes // rows)

    def release_pages(self) -> None:
        """Hand the pages of the map read so far back (``madvise(MADV_DONTNEED)``): they leave
        this process's resident memory and stay in the page cache; a later read of a view
        faults them in again from there. Why: the load reads every block twice (its checks,
        then the copy into the process's own memory), and without this the map's pages and
        the copies were resident together: 702 MB at the peak of the default model's load
        against 530 after (AMD EPYC Zen 4)."""
        mm = getattr(self._memmap, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drop this object's reference to the map (views handed out keep it alive)."""
        self._map = self._memmap = None


def _array(r: MetadataReader, what: str):
    """An array read whole (a tokenizer's tokens, types, merges): strings as ``list[str]``,
    numbers as a numpy array (its dtype from the reader's scalar table). Bounded as every other value."""
    item, count = r.array_start(what)
    if item in SCALAR_FORMATS:
        raw = r.take_counted(count * SCALAR_BYTES[item], what)
        return np.frombuffer(raw, dtype=np.dtype(SCALAR_FORMATS[item])).copy()
    if item == STRING:
        return r.texts(count, what)
    raise GGUFHeaderError(f"{what} is an array of arrays (not read whole)")


def read_gguf_tensors(path: str | Path, arrays: tuple[str, ...] = ()) -> GGUFTensors:
    """The tensor table and scalar metadata of the GGUF file ``path`` (no tensor is read).

    ``arrays`` names metadata arrays to read whole (strings as ``list[str]``, numbers as
    numpy arrays); the others stay ``("array", item type, count)``.

    Raises:
        GGUFHeaderError: not GGUF 2 or 3, truncated, past :mod:`models.safety.gguf_scan`'s
            limits, or a tensor table that does not fit the file.
        OSError: the file cannot be read.
    """
    path = Path(path)
    stats = HeaderStats()
    with open(path, "rb", buffering=0) as f:
        r = MetadataReader.of_file(f, stats)
        r.preamble()
        metadata: dict[str, object] = {}
        for i in range(stats.keys):
            key = r.name(f"metadata key {i}")
            kind = r.u32()
            if kind == ARRAY and key in arrays:
                metadata[key] = _array(r, f"'{key}'")
            else:
                metadata[key] = r.value(kind, f"'{key}'", keep_string=MAX_KEPT_STRING)
        raw_infos = []
        for i in range(stats.tensors):
            name = r.name(f"tensor {i}")
            n_dims = r.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFHeaderError(f"tensor {name!r} has {n_dims} dimensions")
            ne = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims))
            kind, offset = r.u32(), r.u64()
            raw_infos.append((name, ne, kind, offset))
        end_of_header = r.offset
        size = r.size
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-end_of_header // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, kind, offset in raw_infos:
        nbytes = tensor_nbytes(kind, ne, name)
        start = data_offset + offset
        if offset % alignment or start + nbytes > size:
            raise GGUFHeaderError(f"tensor {name!r} lies outside the file")
        if name in tensors:
            raise GGUFHeaderError(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, kind, tuple(int(d) for d in reversed(ne)), start, nbytes)
    return GGUFTensors(path, stats.version, alignment, data_offset, metadata, tensors)


class UnknownBlockType(GGUFHeaderError):
    """A tensor of a block type id gguf does not size (a type newer than this gguf package);
    the message names the tensor and the id."""


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...], name: str = "?") -> int:
    """Bytes of a tensor of ``ggml_type`` with ggml dims ``ne`` (row length first).

    Raises:
        UnknownBlockType: a type gguf does not know.
        GGUFHeaderError: a row length that is not a whole number of blocks.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, bytes_per_block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UnknownBlockType(f"tensor {name!r} has block type {ggml_type}, which this version does not know") from None
    if ne[0] % block:
        raise GGUFHeaderError(f"tensor {name!r}: rows of {ne[0]} are not whole blocks of {block}")
    n = ne[0] // block * bytes_per_block
    for d in ne[1:]:
        n *= d
    return n
