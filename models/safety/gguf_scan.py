"""A bounded first look at a GGUF file's header: refuse metadata that would cost a reader
too much, before any reader builds it in memory. Stdlib only (no numpy, torch, gguf).

Readers build every metadata array element as Python objects. gguf-py's ``GGUFReader``
(transformers' tensor path) makes numpy views per element: measured on the Intel Xeon
(2 vCPUs, shared), ~720 bytes and ~25 us per number and ~1,600 bytes per string
(``tests/models/test_safety_gguf.py`` measures it again); four arrays of 2^20 bytes (a
4 MB file) cost 3.2 GB and 255 s without this scan's bounds. transformers'
own metadata reader (config, tokenizer) turns numeric arrays into Python lists and keeps
the vocabulary and merges as strings. So the scan, walking the header with ``struct``
and ``seek`` and keeping nothing but counts, admits only what real models carry:

- the vocabulary: ``tokenizer.ggml.tokens`` (strings) and its per-token
  ``scores``/``token_type`` (numbers), one common length, at most :data:`MAX_VOCAB`
  (Gemma 3: 262,144); ``tokenizer.ggml.merges`` (strings);
- any other array: at most :data:`MAX_OTHER_ARRAY_ITEMS` items (per-layer values, tags),
  :data:`MAX_OTHER_ITEMS` in all, so an unknown key's big array is refused from its
  count, before one of its items is read;
- what the arrays would cost gguf-py's reader (the costliest we call), estimated from
  the counts above, at most :data:`MAX_READER_BYTES`: Gemma 3 270M's vocabulary comes to
  ~800 MB of it (gguf-py measured 726 MB), Llama 3's ~750 MB;
- strings of at most :data:`MAX_STRING_BYTES` (a chat template), :data:`MAX_METADATA_BYTES`
  in all; at most :data:`MAX_KEYS` keys and :data:`MAX_TENSORS` tensors.

The scan stops at the first count past a limit, so a refused file costs one buffer of
:data:`CHUNK` bytes read and constant memory; an admitted one a walk of its vocabulary
(~0.1 s for 262,144 tokens).

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
from typing import BinaryIO, Callable

#: The scalar value types, by GGUF type id: their ``struct`` formats (little-endian), the one
#: table every GGUF reader here uses (the scan, runtime's tensor reader, the Hub's shape).
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: Their fixed sizes (bytes).
SCALAR_BYTES = {kind: struct.calcsize(fmt) for kind, fmt in SCALAR_FORMATS.items()}
STRING, ARRAY = 8, 9

#: Limits, each well above what real models carry: the largest vocabularies (Gemma 3)
#: hold 262,144 tokens and merges lists stay under ~300k entries (Llama 3: 280,147);
#: chat templates are tens of KB; models have hundreds to a few thousand tensors and
#: tens of metadata keys.
MAX_KEYS = 4_096
MAX_TENSORS = 100_000
#: Bytes of a metadata key's or a tensor's name (real ones are short dotted paths).
MAX_NAME_BYTES = 1024
#: Tokens (and their scores and types) of a vocabulary.
MAX_VOCAB = 300_000
#: The most items any one array may hold (merges are the longest).
MAX_ARRAY_ITEMS = 1 << 20
#: Items of every array together (the reader budget below binds first: 1 GiB / 720 bytes).
MAX_TOTAL_ITEMS = 2_000_000
#: An array under any key but the vocabulary's: per-layer values, tags, languages.
MAX_OTHER_ARRAY_ITEMS = 4_096
MAX_OTHER_ITEMS = 65_536
MAX_STRING_BYTES = 1 << 20
MAX_METADATA_BYTES = 64 << 20
MAX_ARRAY_DEPTH = 2
#: What reading the arrays may cost a reader, estimated per item as gguf-py's GGUFReader
#: costs (measured, see the module docstring): a number, a string (plus its bytes).
READER_BYTES_PER_NUMBER = 720
READER_BYTES_PER_STRING = 1_600
MAX_READER_BYTES = 1 << 30

TOKENS, SCORES, TOKEN_TYPE = "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"
MERGES, ADDED_TOKENS = "tokenizer.ggml.merges", "tokenizer.ggml.added_tokens"
#: The vocabulary's arrays: (limit on items, item types allowed).
VOCABULARY = {
    TOKENS: (MAX_VOCAB, {STRING}),
    ADDED_TOKENS: (MAX_VOCAB, {STRING}),
    SCORES: (MAX_VOCAB, set(SCALAR_BYTES)),
    TOKEN_TYPE: (MAX_VOCAB, set(SCALAR_BYTES)),
    MERGES: (MAX_ARRAY_ITEMS, {STRING}),
}


class GGUFHeaderError(ValueError):
    """The header is malformed, truncated or past a limit (the message says which, in one line)."""


@dataclass
class HeaderStats:
    """What the scan saw: format version, counts, the metadata's size in bytes, the bytes it
    read from the file, and the reader cost it estimated for the arrays (bytes)."""

    version: int = 0
    tensors: int = 0
    keys: int = 0
    items: int = 0
    metadata_bytes: int = 0
    bytes_read: int = 0
    other_items: int = 0
    reader_bytes: int = 0


#: Bytes read at a time: the walk parses lengths out of this buffer, not one read each.
CHUNK = 1 << 20
_U64 = struct.Struct("<Q")

ReadAt = Callable[[int, int], bytes]
"""``read_at(offset, length) -> bytes`` (fewer only at the end of the file)."""


class MetadataReader:
    """The one GGUF metadata reader: a bounded walk of a header through ``read_at``, every value
    counted against the limits above, in :class:`HeaderStats`.

    Args:
        read_at: reads the file (a local file: :meth:`of_file`; the Hub: ranged requests).
        size: the file's size in bytes (None: unknown; a short read then means truncated).
        stats: where the counts go. chunk: bytes read at a time.
    """

    def __init__(self, read_at: ReadAt, size: int | None, stats: HeaderStats, *, chunk: int = CHUNK):
        self.read_at, self.size, self.stats, self.chunk = read_at, size, stats, chunk
        self.buf, self.pos, self.base = b"", 0, 0  # buf holds the file from offset base

    @classmethod
    def of_file(cls, f: BinaryIO, stats: HeaderStats) -> "MetadataReader":
        """A reader over an open binary file (its size from ``fstat``)."""
        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)
        return cls(read_at, os.fstat(f.fileno()).st_size, stats)

    @property
    def offset(self) -> int:
        """Where in the file the walk is (bytes)."""
        return self.base + self.pos

    def _fill(self, n: int) -> None:
        """Make ``buf[pos:pos + n]`` hold the next ``n`` bytes of the file."""
        if self.pos + n <= len(self.buf):
            return
        self.base += self.pos
        if self.size is not None and self.base + n > self.size:
            raise GGUFHeaderError("the file ends inside its metadata (truncated)")
        self.buf, self.pos = self.read_at(self.base, max(n, self.chunk)), 0
        self.stats.bytes_read += len(self.buf)
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

    def preamble(self) -> None:
        """Read the header's start into ``stats``: magic ``GGUF``, version (2 or 3), the tensor
        and metadata key counts (at most :data:`MAX_TENSORS`, :data:`MAX_KEYS`).

        Raises:
            GGUFHeaderError: another magic or version, or a count past its limit.
        """
        if self.take(4) != b"GGUF":
            raise GGUFHeaderError("no GGUF header")
        s = self.stats
        s.version = self.u32()
        if s.version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {s.version} is not supported (2 or 3)")
        s.tensors, s.keys = self.u64(), self.u64()
        if s.tensors > MAX_TENSORS:
            raise GGUFHeaderError(f"it declares {s.tensors:,} tensors (the limit is {MAX_TENSORS:,})")
        if s.keys > MAX_KEYS:
            raise GGUFHeaderError(f"it declares {s.keys:,} metadata keys (the limit is {MAX_KEYS:,})")

    def name(self, what: str) -> str:
        """A metadata key's or a tensor's name (u64 length + UTF-8, undecodable bytes replaced);
        ``what`` names it in the error (``"tensor 3"``).

        Raises:
            GGUFHeaderError: a name over :data:`MAX_NAME_BYTES` bytes.
        """
        n = self.u64()
        if n > MAX_NAME_BYTES:
            raise GGUFHeaderError(f"{what} has a name of {n:,} bytes")
        return self.take(n).decode("utf-8", "replace")

    def _count_bytes(self, n: int, what: str) -> None:
        self.stats.metadata_bytes += n
        if self.stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")

    def skip(self, n: int, what: str) -> None:
        self._count_bytes(n, what)
        if self.size is not None and self.base + self.pos + n > self.size:
            raise GGUFHeaderError("the file ends inside its metadata (truncated)")
        if self.size is None:  # an unknown size: read what is skipped (a short read is a truncation)
            self._fill(n)
        self.pos += n

    def take_counted(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes of metadata, counted against :data:`MAX_METADATA_BYTES`."""
        self._count_bytes(n, what)
        return self.take(n)

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
        self.stats.reader_bytes += total
        if self.stats.metadata_bytes > MAX_METADATA_BYTES:
            raise GGUFHeaderError(f"its metadata passes {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        if self.stats.reader_bytes > MAX_READER_BYTES:
            raise GGUFHeaderError(f"its metadata arrays would take a reader over {MAX_READER_BYTES >> 20:,} MiB "
                                  f"(at {what})")

    def string(self, what: str) -> None:
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise GGUFHeaderError(f"{what} holds a string of {n:,} bytes (the limit is {MAX_STRING_BYTES:,})")
        self.skip(n, what)

    def array_header(self) -> tuple[int, int]:
        """(item type, count) of the array starting here; nothing counted yet (see :meth:`count`)."""
        return self.u32(), self.u64()

    def count(self, item: int, count: int, what: str) -> None:
        """Count an array against the limits on items and on the reader's cost, before any
        of its items is read."""
        if count > MAX_ARRAY_ITEMS:
            raise GGUFHeaderError(f"{what} is an array of {count:,} items (the limit is {MAX_ARRAY_ITEMS:,})")
        s = self.stats
        s.items += count
        s.reader_bytes += count * (READER_BYTES_PER_STRING if item in (STRING, ARRAY) else READER_BYTES_PER_NUMBER)
        if s.reader_bytes > MAX_READER_BYTES:
            raise GGUFHeaderError(f"its metadata arrays would take a reader over {MAX_READER_BYTES >> 20:,} MiB "
                                  f"(at {what}, {count:,} items)")
        if s.items > MAX_TOTAL_ITEMS:
            raise GGUFHeaderError(f"its metadata arrays hold over {MAX_TOTAL_ITEMS:,} items (at {what})")

    def array_items(self, item: int, count: int, what: str, depth: int = 0) -> None:
        if item in SCALAR_BYTES:
            self.skip(count * SCALAR_BYTES[item], what)
        elif item == STRING:
            self.strings(count, what)
        else:
            for _ in range(count):
                self.skip_value(item, what, depth + 1)

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        """Walk past one value, counting it (the scan keeps nothing)."""
        if kind in SCALAR_BYTES:
            self.skip(SCALAR_BYTES[kind], what)
        elif kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFHeaderError(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            item, count = self.array_header()
            if depth:  # an array inside an array counts as another key's array
                _count_other(self.stats, count, what)
            self.count(item, count, what)
            self.array_items(item, count, what, depth)
        else:
            raise GGUFHeaderError(f"{what} has an unknown value type {kind}")


    # ---- values kept (runtime's tensor reader, the Hub's shape) ---------------------------
    def scalar(self, kind: int) -> int | float | bool:
        """One scalar of type ``kind`` (:data:`SCALAR_FORMATS`)."""
        return struct.unpack(SCALAR_FORMATS[kind], self.take(SCALAR_BYTES[kind]))[0]

    def text(self, what: str, keep: int = MAX_STRING_BYTES) -> str | tuple[str, int]:
        """One string, decoded (undecodable bytes replaced); one longer than ``keep`` bytes is
        skipped and returned as ``("string", length)``.

        Raises:
            GGUFHeaderError: a string over :data:`MAX_STRING_BYTES`, metadata past its limit.
        """
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise GGUFHeaderError(f"{what} holds a string of {n:,} bytes (the limit is {MAX_STRING_BYTES:,})")
        if n > keep:
            self.skip(n, what)
            return ("string", n)
        return self.take_counted(n, what).decode("utf-8", "replace")

    def texts(self, count: int, what: str) -> list[str]:
        """``count`` strings, decoded (a vocabulary, merges)."""
        return [self.text(what) for _ in range(count)]

    def array_start(self, what: str) -> tuple[int, int]:
        """(item type, count) of the array starting here, its count checked against
        :data:`MAX_ARRAY_ITEMS` and added to the items of every array (:data:`MAX_TOTAL_ITEMS`)."""
        item, count = self.array_header()
        if count > MAX_ARRAY_ITEMS:
            raise GGUFHeaderError(f"{what} is an array of {count:,} items (the limit is {MAX_ARRAY_ITEMS:,})")
        self.stats.items += count
        if self.stats.items > MAX_TOTAL_ITEMS:
            raise GGUFHeaderError(f"its metadata arrays hold over {MAX_TOTAL_ITEMS:,} items (at {what})")
        return item, count

    def value(self, kind: int, what: str, *, keep_string: int = MAX_STRING_BYTES, keep_items: int = 0):
        """One metadata value of type ``kind``: a scalar, a string (:meth:`text`), or an array:
        a list when its items are scalars and at most ``keep_items``, else walked past and
        returned as ``("array", item type, count)``.

        Raises:
            GGUFHeaderError: past a limit, truncated, an unknown type.
        """
        if kind in SCALAR_FORMATS:
            return self.scalar(kind)
        if kind == STRING:
            return self.text(what, keep_string)
        if kind == ARRAY:
            item, count = self.array_start(what)
            if item in SCALAR_FORMATS and keep_items and count <= keep_items:
                raw = self.take_counted(count * SCALAR_BYTES[item], what)
                return list(struct.unpack(f"<{count}{SCALAR_FORMATS[item][1]}", raw))
            self.array_items(item, count, what)
            return ("array", item, count)
        raise GGUFHeaderError(f"{what} has an unknown value type {kind}")


def _count_other(stats: HeaderStats, count: int, what: str) -> None:
    if count > MAX_OTHER_ARRAY_ITEMS:
        raise GGUFHeaderError(f"{what} is an array of {count:,} items; only a vocabulary may hold more than "
                              f"{MAX_OTHER_ARRAY_ITEMS:,}")
    stats.other_items += count
    if stats.other_items > MAX_OTHER_ITEMS:
        raise GGUFHeaderError(f"its metadata arrays outside the vocabulary hold over {MAX_OTHER_ITEMS:,} items "
                              f"(at {what})")


_TYPE_NAMES = {STRING: "strings", ARRAY: "arrays"}


def _admit(key: str, item: int, count: int, stats: HeaderStats, lengths: dict[str, int]) -> None:
    """The per-key rule on a top-level array, from its header alone."""
    what = f"'{key}'"
    rule = VOCABULARY.get(key)
    if rule is None:
        _count_other(stats, count, what)
        return
    limit, kinds = rule
    if count > limit:
        raise GGUFHeaderError(f"{what} is an array of {count:,} items (the limit is {limit:,})")
    if item not in kinds:
        raise GGUFHeaderError(f"{what} holds {_TYPE_NAMES.get(item, 'numbers')}, not "
                              f"{'strings' if kinds == {STRING} else 'numbers'}")
    if key in lengths:
        raise GGUFHeaderError(f"{what} appears twice")
    lengths[key] = count


def scan_header(path: str | Path, stats: HeaderStats | None = None) -> HeaderStats:
    """Walk the GGUF header of ``path`` and check it against the limits above; returns what
    it saw (in ``stats`` when given, so a caller sees what a refused scan read too).

    Raises:
        GGUFHeaderError: not GGUF version 2 or 3, truncated, or a count, size or cost past
            a limit (the message names the key).
        OSError: the file cannot be read.
    """
    stats = HeaderStats() if stats is None else stats
    lengths: dict[str, int] = {}
    with open(path, "rb", buffering=0) as f:
        r = MetadataReader.of_file(f, stats)
        r.preamble()
        for i in range(stats.keys):
            key = r.name(f"metadata key {i}")
            kind, what = r.u32(), f"'{key}'"
            if kind != ARRAY:
                r.skip_value(kind, what)
                continue
            item, count = r.array_header()
            _admit(key, item, count, stats, lengths)
            r.count(item, count, what)
            r.array_items(item, count, what)
    for key in (SCORES, TOKEN_TYPE):
        if key in lengths and lengths[key] != lengths.get(TOKENS):
            raise GGUFHeaderError(f"'{key}' holds {lengths[key]:,} items for {lengths.get(TOKENS, 0):,} tokens")
    return stats
