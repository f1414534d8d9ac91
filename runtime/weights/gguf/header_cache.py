"""A GGUF's header as :func:`runtime.weights.gguf.mmap.read_gguf_tensors` read it, kept in the
cache folder beside the checks' verdict, so that loading the same unchanged file skips the walk.

Must not import Qt. Why: the walk reads past every metadata string to find the tensor table
(Gemma 3's 262,144 tokens and 514,906 merges: 0.15-0.2 s of Python in a 1.0 s warm load, Intel
Xeon, 2 cores). A kept header is used only for a file that passed every check and is the same
file now (:func:`runtime.weights.checked.passed`: its device, inode, size, modification and
status-change times), and only when it names that same identity; anything else (another
version of this format, a damaged or foreign file) is read again from the GGUF.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from runtime.weights import checked
from runtime.weights.gguf.mmap import GGUFTensors, TensorInfo

log = logging.getLogger(__name__)

__all__ = ["keep", "load"]

#: The format of a kept header; another one is not read.
VERSION = 1


def _encode(value):
    if isinstance(value, tuple):   # ("array", item type, count), ("string", length)
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict):
        return tuple(_decode(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def keep(path: Path, g: GGUFTensors, before: dict | None) -> None:
    """Keep ``g``, read from ``path`` while its identity was ``before``
    (:func:`runtime.weights.checked.identity`, taken before the read): not kept when the file
    changed since (atomic; a failure only costs the next load the walk)."""
    target, identity = checked.beside(path, "header"), checked.identity(path)
    if target is None or identity is None or identity != before:
        return
    data = {"version": VERSION, "identity": identity, "gguf_version": g.version, "alignment": g.alignment,
            "data_offset": g.data_offset, "metadata": {k: _encode(v) for k, v in g.metadata.items()},
            "tensors": [[t.name, t.ggml_type, list(t.shape), t.offset, t.nbytes] for t in g.tensors.values()]}
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, target)
    except (OSError, TypeError, ValueError):
        log.warning("could not keep the header of %s", path, exc_info=True)
        tmp.unlink(missing_ok=True)


def load(path: Path) -> GGUFTensors | None:
    """The header kept for ``path`` as it is now, or None (not kept, not this file, not checked)."""
    target = checked.beside(path, "header")
    if target is None or not target.exists() or not checked.passed(path):
        return None
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
        if data.get("version") != VERSION or data.get("identity") != checked.identity(path):
            return None
        tensors = {name: TensorInfo(name, int(kind), tuple(int(d) for d in shape), int(offset), int(nbytes))
                   for name, kind, shape, offset, nbytes in data["tensors"]}
        return GGUFTensors(Path(path), int(data["gguf_version"]), int(data["alignment"]), int(data["data_offset"]),
                           {k: _decode(v) for k, v in data["metadata"].items()}, tensors)
    except (OSError, ValueError, KeyError, TypeError):
        return None
