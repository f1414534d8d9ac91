"""A GGUF's header kept in the cache folder: the same tensor table and metadata as a fresh
read, used only for a file that passed its checks and is unchanged, read again otherwise."""
from __future__ import annotations

import json
import os

import pytest

from runtime import load_model
from runtime.weights import checked
from runtime.weights.gguf import header_cache, mmap
from runtime.weights.gguf.open import open_gguf
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_gguf(tmp_path, tokenizer=tiny_tokenizer_metadata())


def _reads(monkeypatch) -> list:
    seen = []
    real = mmap.read_gguf_tensors
    from runtime.weights.gguf import open as gguf_open

    monkeypatch.setattr(gguf_open, "read_gguf_tensors", lambda p, *a, **k: (seen.append(p), real(p, *a, **k))[1])
    return seen


def _same(a, b):
    assert (a.version, a.alignment, a.data_offset) == (b.version, b.alignment, b.data_offset)
    assert a.metadata == b.metadata and list(a.metadata) == list(b.metadata)
    assert {k: type(v) for k, v in a.metadata.items()} == {k: type(v) for k, v in b.metadata.items()}
    assert a.tensors == b.tensors and list(a.tensors) == list(b.tensors)


def test_a_checked_file_is_opened_from_its_kept_header(gguf, monkeypatch):
    reads = _reads(monkeypatch)
    load_model(gguf, device="cpu")   # reads, checks, keeps
    assert len(reads) == 1 and checked.passed(gguf)
    kept = open_gguf(gguf)
    assert len(reads) == 1, "a checked, unchanged file was walked again"
    _same(kept, mmap.read_gguf_tensors(gguf))
    assert any(isinstance(v, tuple) and v[0] == "array" for v in kept.metadata.values())   # the tokenizer's arrays
    assert load_model(gguf, device="cpu").encode("hello") == load_model(gguf, device="cpu").encode("hello")


def test_a_changed_file_or_a_damaged_header_is_read_again(gguf, monkeypatch):
    reads = _reads(monkeypatch)
    load_model(gguf, device="cpu")
    target = checked.beside(gguf, "header")
    target.write_text("{not json")
    open_gguf(gguf)
    assert len(reads) == 2   # damaged: read again (and kept again)
    assert json.loads(target.read_text())["version"] == header_cache.VERSION
    data = json.loads(target.read_text())
    data["version"] = header_cache.VERSION + 1
    target.write_text(json.dumps(data))
    open_gguf(gguf)
    assert len(reads) == 3   # another format: read again
    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))   # same times, but the status-change time moves
    assert header_cache.load(gguf) is None
    load_model(gguf, device="cpu")
    assert len(reads) == 4


def test_nothing_is_kept_when_the_file_changed_during_the_read(gguf):
    g = mmap.read_gguf_tensors(gguf)
    before = checked.identity(gguf)
    with open(gguf, "ab") as f:
        f.write(b"\0")
    header_cache.keep(gguf, g, before)
    assert not checked.beside(gguf, "header").exists()
    header_cache.keep(gguf, g, checked.identity(gguf))
    assert checked.beside(gguf, "header").exists()
    assert header_cache.load(gguf) is None   # kept, but the changed file has not passed its checks


@pytest.mark.parametrize("entry_name", ["DEFAULT_MODEL", "GEMMA3_270M"])
def test_a_real_files_kept_header_is_its_header(entry_name, tmp_path, monkeypatch):
    """Every metadata value of the real files (floats, flags, long strings, arrays) and every
    tensor come back from the kept header as read, type for type."""
    import models
    from models import catalog

    entry = getattr(catalog, entry_name)
    path = models.installed_path(entry) or models.fetch_model(entry)
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path))
    g = mmap.read_gguf_tensors(path)
    header_cache.keep(path, g, checked.identity(path))
    monkeypatch.setattr(checked, "passed", lambda p: True)
    _same(header_cache.load(path), g)
