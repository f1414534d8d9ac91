"""A bounded first look at a GGUF file's header: refuse oversized metadata before any
reader builds it in memory. Must not import Qt, torch or transformers (stdlib only).

gguf-py (the reader transformers uses) turns every element of a metadata array into
its own Python objects: one 3 MB byte array in a 5 MB file cost 3.4 GiB and 85 s
(issue 20). This scan walks the header with ``struct`` and ``seek``, keeping nothing
but counts, and stops at the first size past a limit, so it costs at most a few
hundred thousand small reads and constant memory.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3,
little-endian): magic ``GGUF``, version u32, tensor count u64, metadata count u64, then
per entry a key (u64 length + UTF-8) and a typed value; strings are u64 length + bytes,
arrays are an element type u32 + u64 count + the elements.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

#: Fixed sizes (bytes) of the scalar value types, by GGUF type id.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9

#: Limits, each well above what real models carry: the largest vocabularies (Gemma 3)
#: hold ~262k tokens and merges lists stay under ~600k entries; chat templates are tens
#: of KB; models have hundreds to a few thousand tensors and tens of metadata keys.
MAX_KEYS = 10_000
MAX_TENSORS = 100_000
MAX_ARRAY_ITEMS = 1 << 20
MAX_TOTAL_ITEMS = 4 << 20
MAX_STRING_BYTES = 1 << 20
MAX_METADATA_BYTES = 64 << 20
MAX_ARRAY_DEPTH = 2


class GGUFHeaderError(ValueError):
    """The header is malformed, truncated or past a limit (the message says which, in one line)."""


@dataclass
class HeaderStats:
    """What the scan saw: format version, counts, and the metadata's size in bytes."""

    version: int = 0
    tensors: int = 0
    keys: int = 0
    items: int = 0
    metadata_bytes: int = 0


#: Bytes read at a time: the walk parses lengths out of this buffer, not one read each.
CHUNK = 1 << 20
_U64 = struct.Struct("<Q")


class _Reader:
    def __init__(self, f: BinaryIO, stats: HeaderStats):
        self.f, self.stats = f, stats
        self.size = os.fstat(f.fileno()).st_size
        self.buf, self.pos, self.base = b"", 0, 0  # buf holds the file from offset base

    def _fill(self, n: int) -> None:
        """Make ``buf[pos:pos + n]`` hold the next ``n`` bytes of the file."""
        if self.pos + n <= len(self.buf):
            return
        self.base += self.pos
        self.f.seek(self.base)
        self.buf, self.pos = self.f.read(max(n, CHUNK)), 0
        if len(self.buf) < n:
            raise GGUFHeaderError("the file ends inside its metadata (truncated)")

    def take(self, n: int) -> bytes:
        self._fill(n)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def skip(self, n: int, what: str) -> None:
        self.stats.metadata_bytes += n
        if self.stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        if self.base + self.pos + n > self.size:
            raise GGUFHeaderError("the file ends inside its metadata (truncated)")
        self.pos += n

    def strings(self, count: int, what: str) -> None:
        """Skip ``count`` strings (a vocabulary: the loop that must stay cheap, so the
        common case, a length and its bytes inside the buffer, is inlined)."""
        unpack, total = _U64.unpack_from, 0
        for _ in range(count):
            buf, pos = self.buf, self.pos
            if pos + 8 <= len(buf):
                n = unpack(buf, pos)[0]
                if n <= MAX_STRING_BYTES and pos + 8 + n <= len(buf):
                    self.pos = pos + 8 + n
                    total += n
                    continue
            self.string(what)
        self.stats.metadata_bytes += total
        if self.stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")

    def string(self, what: str) -> None:
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise GGUFHeaderError(f"{what} holds a string of {n:,} bytes (the limit is {MAX_STRING_BYTES:,})")
        self.skip(n, what)

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in SCALAR_BYTES:
            self.skip(SCALAR_BYTES[kind], what)
        elif kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFHeaderError(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            item, count = self.u32(), self.u64()
            if count > MAX_ARRAY_ITEMS:
                raise GGUFHeaderError(f"{what} is an array of {count:,} items (the limit is {MAX_ARRAY_ITEMS:,})")
            self.stats.items += count
            if self.stats.items > MAX_TOTAL_ITEMS:
                raise GGUFHeaderError(f"its metadata arrays hold over {MAX_TOTAL_ITEMS:,} items (at {what})")
            if item in SCALAR_BYTES:
                self.skip(count * SCALAR_BYTES[item], what)
            elif item == STRING:
                self.strings(count, what)
            else:
                for _ in range(count):
                    self.value(item, what, depth + 1)
        else:
            raise GGUFHeaderError(f"{what} has an unknown value type {kind}")


def scan_header(path: str | Path) -> HeaderStats:
    """Walk the GGUF header of ``path`` and check its sizes against the limits above.

    Raises:
        GGUFHeaderError: not GGUF version 2 or 3, truncated, or a count or size past a
            limit (the message names the key).
        OSError: the file cannot be read.
    """
    stats = HeaderStats()
    with open(path, "rb", buffering=0) as f:
        r = _Reader(f, stats)
        if r.take(4) != b"GGUF":
            raise GGUFHeaderError("no GGUF header")
        stats.version = r.u32()
        if stats.version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {stats.version} is not supported (2 or 3)")
        stats.tensors, stats.keys = r.u64(), r.u64()
        if stats.tensors > MAX_TENSORS:
            raise GGUFHeaderError(f"it declares {stats.tensors:,} tensors (the limit is {MAX_TENSORS:,})")
        if stats.keys > MAX_KEYS:
            raise GGUFHeaderError(f"it declares {stats.keys:,} metadata keys (the limit is {MAX_KEYS:,})")
        for i in range(stats.keys):
            n = r.u64()
            if n > 1024:
                raise GGUFHeaderError(f"metadata key {i} has a name of {n:,} bytes")
            key = r.take(n).decode("utf-8", "replace")
            r.value(r.u32(), f"'{key}'")
    return stats
