"""A GGUF file's tensors as memory-mapped raw blocks: names, block types, shapes and byte
ranges, read without dequantizing anything. Must not import Qt or transformers.

Why not ``gguf.GGUFReader``: it turns every element of every metadata array into numpy
views before it lists a single tensor. Measured on the Intel Xeon (2 cores, busy):
22 s and 198 MB for the default model (49,152-token vocabulary), 79 s and 726 MB for
Gemma 3 270M (262,144 tokens), the time of a first reply many times over. This reader
walks the header with :mod:`models.safety.gguf_scan`'s bounded reader (the same limits,
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

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.safety.gguf_scan import (
    ARRAY, MAX_ARRAY_ITEMS, MAX_METADATA_BYTES, MAX_STRING_BYTES, MAX_TOTAL_ITEMS, SCALAR_BYTES, STRING,
    GGUFHeaderError, HeaderStats, _Reader,
)

#: struct formats of the scalar metadata types (GGUF type id -> format).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
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

    def mapped(self) -> torch.Tensor:
        """The whole file as a ``uint8`` tensor over a private (copy-on-write) memory map:
        its pages are the file's, read on first touch, never copied unless written."""
        if self._map is None:
            arr = np.memmap(self.path, dtype=np.uint8, mode="c")  # MAP_PRIVATE: writable, file-backed
            self._map = torch.from_numpy(arr)
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

    def close(self) -> None:
        """Drop this object's reference to the map (views handed out keep it alive)."""
        self._map = None


#: numpy dtypes of the numeric array item types (GGUF type id -> dtype).
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def _array_header(r: _Reader, what: str, stats: HeaderStats) -> tuple[int, int]:
    """(item type, count) of the array starting here, its count checked against
    :data:`MAX_ARRAY_ITEMS` and added to the items of every array (:data:`MAX_TOTAL_ITEMS`)."""
    item, count = r.array_header()
    if count > MAX_ARRAY_ITEMS:
        raise GGUFHeaderError(f"{what} is an array of {count:,} items (the limit is {MAX_ARRAY_ITEMS:,})")
    stats.items += count
    if stats.items > MAX_TOTAL_ITEMS:
        raise GGUFHeaderError(f"its metadata arrays hold over {MAX_TOTAL_ITEMS:,} items (at {what})")
    return item, count


def _array(r: _Reader, what: str, stats: HeaderStats):
    """An array read whole (a tokenizer's tokens, types, merges): strings as ``list[str]``,
    numbers as a numpy array. Bounded as every other value."""
    item, count = _array_header(r, what, stats)
    if item in _ARRAY_DTYPES:
        n = count * SCALAR_BYTES[item]
        stats.metadata_bytes += n
        if stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        return np.frombuffer(r.take(n), dtype=_ARRAY_DTYPES[item]).copy()
    if item == STRING:
        out = []
        for _ in range(count):
            n = r.u64()
            if n > MAX_STRING_BYTES:
                raise GGUFHeaderError(f"{what} holds a string of {n:,} bytes (the limit is {MAX_STRING_BYTES:,})")
            stats.metadata_bytes += n
            out.append(r.take(n).decode("utf-8", "replace"))
        if stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        return out
    raise GGUFHeaderError(f"{what} is an array of arrays (not read whole)")


def _value(r: _Reader, kind: int, what: str, stats: HeaderStats):
    """Read one metadata value: scalars and strings up to :data:`MAX_KEPT_STRING` bytes are
    returned; longer strings as ``("string", length)``; arrays are skipped (bounded, as
    :func:`models.safety.gguf_scan.scan_header`) and returned as ``("array", item type, count)``."""
    if kind in _SCALAR_FORMATS:
        return struct.unpack(_SCALAR_FORMATS[kind], r.take(SCALAR_BYTES[kind]))[0]
    if kind == STRING:
        n = r.u64()
        if n > MAX_STRING_BYTES:
            raise GGUFHeaderError(f"{what} holds a string of {n:,} bytes (the limit is {MAX_STRING_BYTES:,})")
        if n > MAX_KEPT_STRING:
            r.skip(n, what)
            return ("string", n)
        text = r.take(n)
        stats.metadata_bytes += n
        if stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        return text.decode("utf-8", "replace")
    if kind == ARRAY:
        item, count = _array_header(r, what, stats)
        r.array_items(item, count, what)
        return ("array", item, count)
    raise GGUFHeaderError(f"{what} has an unknown value type {kind}")


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
        r = _Reader(f, stats)
        r.preamble()
        metadata: dict[str, object] = {}
        for i in range(stats.keys):
            key = r.name(f"metadata key {i}")
            kind = r.u32()
            if kind == ARRAY and key in arrays:
                metadata[key] = _array(r, f"'{key}'", stats)
            else:
                metadata[key] = _value(r, kind, f"'{key}'", stats)
        raw_infos = []
        for i in range(stats.tensors):
            name = r.name(f"tensor {i}")
            n_dims = r.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFHeaderError(f"tensor {name!r} has {n_dims} dimensions")
            ne = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims))
            kind, offset = r.u32(), r.u64()
            raw_infos.append((name, ne, kind, offset))
        end_of_header = r.base + r.pos
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
            raise GGUFHeaderError(f"tensor {name!r} lies outside the file (truncated?)")
        if name in tensors:
            raise GGUFHeaderError(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, kind, tuple(int(d) for d in reversed(ne)), start, nbytes)
    return GGUFTensors(path, stats.version, alignment, data_offset, metadata, tensors)


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...], name: str = "?") -> int:
    """Bytes of a tensor of ``ggml_type`` with ggml dims ``ne`` (row length first).

    Raises:
        GGUFHeaderError: an unknown type, or a row length that is not a whole number of blocks.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, bytes_per_block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFHeaderError(f"tensor {name!r} has an unknown block type {ggml_type}") from None
    if ne[0] % block:
        raise GGUFHeaderError(f"tensor {name!r}: rows of {ne[0]} are not whole blocks of {block}")
    n = ne[0] // block * bytes_per_block
    for d in ne[1:]:
        n *= d
    return n
