"""GGUF headers for the tests of models.safety's scan (a helper, not a test file): raw
metadata entries, and files built to exhaust a reader (:func:`metadata_bomb_files`)."""
from __future__ import annotations

import struct
from pathlib import Path

STRING, ARRAY, U8, I32, F32 = 8, 9, 0, 5, 6


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def string_entry(name: str, value: str) -> bytes:
    return key(name) + struct.pack("<IQ", STRING, len(value.encode())) + value.encode()


def array_entry(name: str, item_type: int, count: int, payload: bytes) -> bytes:
    return key(name) + struct.pack("<IIQ", ARRAY, item_type, count) + payload


def strings(values) -> bytes:
    return b"".join(struct.pack("<Q", len(v.encode())) + v.encode() for v in values)


def gguf(path: Path, *entries: bytes, tensors: int = 0) -> Path:
    """A GGUF v3 header with the given raw metadata entries (and no tensor data)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, len(entries)) + b"".join(entries))
    return path


def vocabulary(n: int, *, scores: bool = True, types: bool = True, merges: int = 0) -> list[bytes]:
    """A tokenizer's arrays as llama.cpp writes them: ``n`` tokens, their scores and types."""
    out = [string_entry("tokenizer.ggml.model", "gpt2"),
           array_entry("tokenizer.ggml.tokens", STRING, n, strings(f"t{i}" for i in range(n)))]
    if scores:
        out.append(array_entry("tokenizer.ggml.scores", F32, n, struct.pack(f"<{n}f", *range(n))))
    if types:
        out.append(array_entry("tokenizer.ggml.token_type", I32, n, struct.pack(f"<{n}i", *([1] * n))))
    if merges:
        out.append(array_entry("tokenizer.ggml.merges", STRING, merges, strings(f"t{i} t{i}" for i in range(merges))))
    return out


ARCH = string_entry("general.architecture", "llama")


def metadata_bomb_files(folder: Path) -> dict[str, Path]:
    """GGUF metadata bombs (each within a scan of counts alone, each gigabytes to a plain reader):
    name -> file."""
    n = 1 << 20
    return {
        # 4 MB: 255 s and 3.2 GB in the reader
        "4x2^20-bytes": gguf(folder / "bytes.gguf", ARCH, *(array_entry(f"evil.{c}", U8, n, bytes(n)) for c in "abcd")),
        # 32 MB: past 6.8 GB and 300 s
        "4x2^20-empty-strings": gguf(folder / "strings.gguf", ARCH,
                                     *(array_entry(f"evil.{c}", STRING, n, bytes(8 * n)) for c in "abcd")),
        # 4.3 MB: 272 s at 3.0 GB
        "10000x400-items": gguf(folder / "keys.gguf", ARCH,
                                *(array_entry(f"evil.{i}", U8, 400, bytes(400)) for i in range(10_000))),
        # the same under the key limit: 4,000 keys
        "4000x400-items": gguf(folder / "keys4k.gguf", ARCH,
                               *(array_entry(f"evil.{i}", U8, 400, bytes(400)) for i in range(4_000))),
    }
