"""models.store: import_model, list_models, and `attnchat models list|import`."""
from __future__ import annotations

import argparse
import builtins
import errno
import hashlib
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest

from attnchat.cli import models as models_cmd
from models import store
from models.catalog import CATALOG, DEFAULT_MODEL
from models.store import ImportModelError, import_model, list_models

#: A GGUF header (version 3, no tensors, no metadata: it passes models.safety's scan), then bytes.
GGUF_HEADER = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
GGUF_BYTES = GGUF_HEADER + bytes(range(256)) * 40


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = tmp_path / "models"
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(path))
    return path


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src"
    path.mkdir()
    return path


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def one_line_error(call, *args) -> str:
    with pytest.raises(ImportModelError) as info:
        call(*args)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def make_hf_folder(root: Path) -> Path:
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (model / "tokenizer.json").write_text("{}")
    (model / "pytorch_model.bin").write_bytes(b"pickled")
    return model


# --- files --------------------------------------------------------------------------------

def test_import_gguf_copies_bytes_and_lists_it(folder, src):
    source = src / "tiny.gguf"
    source.write_bytes(GGUF_BYTES)
    path = import_model(source)
    assert path == folder / "tiny.gguf"
    assert path.read_bytes() == GGUF_BYTES and source.read_bytes() == GGUF_BYTES
    assert names(folder) == ["tiny.gguf"]  # no temp file left
    rows = list_models()
    assert [(r.id, r.source, r.installed) for r in rows] == [
        *((e.id, "catalog", False) for e in CATALOG), ("tiny.gguf", "imported", True)]
    assert rows[0].id == DEFAULT_MODEL.id and rows[1].id == "gemma3-270m"
    row = rows[len(CATALOG)]
    assert row.path == path and row.size_bytes == len(GGUF_BYTES) and row.name == "tiny"


def test_import_same_file_twice_is_idempotent_but_a_different_one_is_refused(folder, src):
    source = src / "tiny.gguf"
    source.write_bytes(GGUF_BYTES)
    first = import_model(str(source))
    assert import_model(source) == first
    assert import_model(first) == first  # importing the installed file itself
    other = src / "other" / "tiny.gguf"
    other.parent.mkdir()
    other.write_bytes(GGUF_HEADER + b"different")
    assert "already exists" in one_line_error(import_model, other)
    assert first.read_bytes() == GGUF_BYTES


def test_gguf_magic_without_suffix_gets_gguf_suffix(folder, src):
    source = src / "weights"
    source.write_bytes(GGUF_BYTES)
    assert import_model(source) == folder / "weights.gguf"


@pytest.mark.parametrize("content", [b"PK\x03\x04zip", b"GGU", b"", b"gguf lowercase"])
def test_non_gguf_file_is_refused(folder, src, content):
    source = src / "model.gguf"
    source.write_bytes(content)
    message = one_line_error(import_model, source)
    assert "not a GGUF file" in message and str(source) in message
    assert names(folder) == []


class Exploit:
    """Unpickling this creates a marker file: proof that the pickle was loaded."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".PT"])
def test_pickle_files_are_refused_without_being_opened(folder, src, tmp_path, monkeypatch, suffix):
    exploit = Exploit()
    exploit.marker = tmp_path / "unpickled"
    source = src / f"model{suffix}"
    source.write_bytes(b"GGUF" + pickle.dumps(exploit))  # even a GGUF-looking prefix is refused
    opened: list[str] = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    message = one_line_error(import_model, source)
    monkeypatch.undo()
    assert "pickled" in message and str(source) in message
    assert str(source) not in opened
    assert not exploit.marker.exists()
    assert names(folder) == []


def test_missing_path(folder, tmp_path):
    message = one_line_error(import_model, tmp_path / "nope.gguf")
    assert "no such file or folder" in message and "nope.gguf" in message


def test_file_named_like_the_catalog_model_must_match_its_checksum(folder, src):
    source = src / DEFAULT_MODEL.filename
    source.write_bytes(GGUF_BYTES)
    assert "checksum" in one_line_error(import_model, source)
    assert names(folder) == []


def test_disk_full_while_copying_leaves_nothing(folder, src, monkeypatch):
    source = src / "tiny.gguf"
    source.write_bytes(GGUF_BYTES)

    def full(fin, fout, length=0):
        fout.write(fin.read(10))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", full)
    message = one_line_error(import_model, source)
    assert "No space left on device" in message and "free some disk space" in message
    assert names(folder) == []


# --- folders ------------------------------------------------------------------------------

def test_import_hf_folder_skips_pickles(folder, src):
    source = make_hf_folder(src)
    path = import_model(source)
    assert path == folder / "tiny-llama"
    assert names(path) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (path / "config.json").read_text() == '{"model_type": "llama"}'
    assert names(folder) == ["tiny-llama"]
    row = list_models()[len(CATALOG)]
    assert (row.id, row.source, row.path) == ("tiny-llama", "imported", path)
    assert row.size_bytes == sum(p.stat().st_size for p in path.iterdir())
    assert "already exists" in one_line_error(import_model, source)


def test_folder_without_config_json_is_refused(folder, src):
    (src / "model.safetensors").write_bytes(b"x")
    assert "no config.json" in one_line_error(import_model, src)
    assert names(folder) == []


def test_folder_with_only_pickled_weights_is_refused(folder, src):
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"pickled")
    assert "safetensors" in one_line_error(import_model, src)
    assert names(folder) == []


def test_list_models_ignores_other_files(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    (folder / "x.gguf.part").write_bytes(b"GGUF")
    (folder / ".hidden.gguf").write_bytes(b"GGUF")
    (folder / "empty-dir").mkdir()
    (folder / "b.gguf").write_bytes(b"GGUF1")
    (folder / "A.gguf").write_bytes(b"GGUF22")
    assert [(r.id, r.size_bytes) for r in list_models()] == [
        *((e.id, e.size_bytes) for e in CATALOG), ("A.gguf", 6), ("b.gguf", 5)]
    assert list_models()[0].path is None


# --- the command line ---------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="attnchat")
    models_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["models", *argv])


def test_cli_import_prints_new_path(folder, src, capsys):
    source = src / "tiny.gguf"
    source.write_bytes(GGUF_BYTES)
    args = parse("import", str(source))
    assert args.func is models_cmd.run
    assert models_cmd.run(args) == 0
    assert capsys.readouterr() == (f"{folder / 'tiny.gguf'}\n", "")


@pytest.mark.parametrize("name,content", [("missing.gguf", None), ("model.pt", b"x"), ("a.gguf", b"nope")])
def test_cli_import_errors_are_one_line_exit_2(folder, src, capsys, name, content):
    if content is not None:
        (src / name).write_bytes(content)
    assert models_cmd.run(parse("import", str(src / name))) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("attnchat: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_list_json_and_table(folder, src, capsys):
    (src / "tiny.gguf").write_bytes(GGUF_BYTES)
    import_model(src / "tiny.gguf")
    assert models_cmd.run(parse("list", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {"id": DEFAULT_MODEL.id, "name": DEFAULT_MODEL.name, "path": None,
                       "installed": False, "size_bytes": DEFAULT_MODEL.size_bytes, "source": "catalog",
                       "license": "Apache-2.0", "chat_template": True}
    assert rows[1]["id"] == "gemma3-270m" and rows[1]["license"] == "Gemma Terms of Use"
    assert rows[1]["chat_template"] is False  # the base model: it continues text
    n = len(CATALOG)
    assert rows[n]["path"] == str(folder / "tiny.gguf") and rows[n]["installed"] is True
    assert rows[n]["chat_template"] is None  # not known before it is loaded

    assert models_cmd.run(parse("list")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "SIZE", "STATUS", "USE", "SOURCE", "LICENSE", "PATH"]
    assert lines[1].startswith(DEFAULT_MODEL.id) and "not installed" in lines[1] and "93.8 MiB" in lines[1]
    assert "  chat  " in lines[1] and "completion" not in lines[1]
    assert lines[2].startswith("gemma3-270m") and "241.4 MiB" in lines[2] and "Gemma Terms of Use" in lines[2]
    assert "  completion only (no chat template)  " in lines[2]
    assert lines[n + 1].startswith("tiny.gguf") and lines[n + 1].endswith(str(folder / "tiny.gguf"))
    assert len(lines) == n + 2


def test_cli_unusable_models_dir_is_exit_2(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(blocker / "models"))
    assert models_cmd.run(parse("list")) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnchat: error: ") and "ATTNCHAT_MODELS_DIR" in err and err.count("\n") == 1


def test_sha256_helper_matches_hashlib(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(GGUF_BYTES * 300)
    assert store._sha256_file(path) == hashlib.sha256(GGUF_BYTES * 300).hexdigest()
