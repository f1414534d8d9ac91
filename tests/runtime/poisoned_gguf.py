"""Poisoned copies of a tiny GGUF for tests (a helper, not a test file): the same file with
metadata values changed, tensors cut to another shape, relabelled as another type, or their
blocks' scales set to NaN or Inf; written with gguf's own writer, as an attacker would."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np


def rewrite(src: Path, dst: Path, *, metadata: dict | None = None, shapes: dict[str, tuple[int, int]] | None = None,
            types: dict[str, str] | None = None, blocks: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None,
            drop: tuple[str, ...] = ()) -> Path:
    """Write ``dst``: ``src`` with ``metadata`` (key -> new value, same GGUF value type as
    before; a new key is written as uint32), ``shapes`` (tensor -> (rows, cols): the first
    rows, the first columns' blocks), ``types`` (tensor -> another type name, bytes kept,
    cut to the new type's size), ``blocks`` (tensor -> a function of its raw ``uint8 (rows,
    row_bytes)`` array) and without the tensors in ``drop``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    metadata, shapes, types, blocks = metadata or {}, shapes or {}, types or {}, blocks or {}
    r = GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    done = set()
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        value = metadata.get(name, f.contents())
        done.add(name)
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for name, value in metadata.items():
        if name not in done:
            w.add_uint32(name, int(value))
    for t in r.tensors:
        if t.name in drop:
            continue
        qtype = GGMLQuantizationType[types[t.name]] if t.name in types else t.tensor_type
        block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
        cols = int(t.shape[0])
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, cols // block * nbytes)
        if t.name in shapes:
            want_rows, want_cols = shapes[t.name]
            raw = raw[:want_rows, : want_cols // block * nbytes]
            rows, cols = want_rows, want_cols
        if t.name in blocks:
            raw = blocks[t.name](raw.copy())
        if qtype != t.tensor_type:
            new_block, new_bytes = GGML_QUANT_SIZES[qtype]
            row = cols // new_block * new_bytes
            flat = raw.reshape(-1)
            flat = np.concatenate([flat, np.zeros(max(0, rows * row - flat.size), np.uint8)])[: rows * row]
            raw = flat.reshape(rows, row)
        if len(t.shape) == 1:
            raw = raw.reshape(-1)
        dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype)
        if dtype is not None:
            w.add_tensor(t.name, raw.view(dtype).reshape((rows, cols) if len(t.shape) > 1 else (cols,)))
        else:
            w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)  # the byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def nan_scales(block_bytes: int, at: int = 0, value: float = float("nan")) -> Callable[[np.ndarray], np.ndarray]:
    """A ``blocks`` function: every block's float16 at byte ``at`` (the scale ``d`` of Q4_K,
    Q8_0, Q4_0...) set to ``value``."""
    def poison(raw: np.ndarray) -> np.ndarray:
        b = raw.reshape(-1, block_bytes)
        b[:, at:at + 2] = np.array([value], dtype="<f2").view(np.uint8)
        return raw

    return poison


def relabel_in_place(src: Path, dst: Path, name: str, type_name: str) -> Path:
    """Write ``dst``: ``src`` with tensor ``name``'s type id changed in its header entry, its
    bytes and every offset left as they were (so a type with bigger blocks runs into the
    next tensor's bytes)."""
    import struct

    from gguf import GGMLQuantizationType

    data = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, GGMLQuantizationType[type_name].value)
    dst.write_bytes(bytes(data))
    return dst
