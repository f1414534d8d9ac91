"""A GGUF that passed the header walk and the scale scan is not walked again while it is the
same file; any change to it (a rewrite, even with its old modification time) is checked again,
and a refused file is never remembered."""
from __future__ import annotations

import os

import pytest

from runtime import load_model
from runtime.errors import ModelLoadError
from runtime.weights import checked, validate
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_gguf(tmp_path, tokenizer=tiny_tokenizer_metadata())


def _walks(monkeypatch) -> list[str]:
    """Record each walk of a file's contents (still running them)."""
    from models import safety

    seen: list[str] = []
    header, scan = safety.check_gguf, validate._scan
    monkeypatch.setattr(safety, "check_gguf", lambda path, *a, **k: (seen.append("header"), header(path, *a, **k))[1])
    monkeypatch.setattr(validate, "_scan", lambda path, g: (seen.append("scales"), scan(path, g))[1])
    return seen


def test_an_unchanged_file_is_walked_once(gguf, monkeypatch):
    seen = _walks(monkeypatch)
    load_model(gguf, device="cpu")
    assert seen == ["header", "scales"] and checked.passed(gguf)
    load_model(gguf, device="cpu")
    assert seen == ["header", "scales"], "the second load walked the file again"


def test_a_rewritten_file_is_walked_again_even_with_its_old_times(gguf, monkeypatch):
    load_model(gguf, device="cpu")
    assert checked.passed(gguf)
    st = os.stat(gguf)
    data = bytearray(gguf.read_bytes())
    gguf.write_bytes(bytes(data))          # the same bytes, rewritten
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))   # and its old modification time put back
    assert not checked.passed(gguf)
    seen = _walks(monkeypatch)
    load_model(gguf, device="cpu")
    assert seen == ["header", "scales"]


def test_a_refused_file_is_not_remembered(gguf, monkeypatch):
    def refuse(path, g):
        raise ModelLoadError(f"{path.name}: tensor 'blk.0.attn_q.weight' has NaN scales")

    monkeypatch.setattr(validate, "_scan", refuse)
    for _ in range(2):   # refused each time: nothing remembered from the first
        with pytest.raises(ModelLoadError, match="NaN scales"):
            load_model(gguf, device="cpu")
    assert not checked.passed(gguf)


def test_other_checks_forget_every_verdict(gguf, monkeypatch):
    load_model(gguf, device="cpu")
    assert checked.passed(gguf)
    monkeypatch.setattr(checked, "CHECKS", checked.CHECKS + "-stricter")
    assert not checked.passed(gguf)
