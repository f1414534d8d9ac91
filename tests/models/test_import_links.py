"""Importing a model folder copies the regular files inside it, nothing a link points to
(following them, a ``home -> /root`` link would copy 7.4 GB, a link to ``/dev/zero`` write
until a ulimit stopped it, a link to someone's 0600 file be copied). Names are logged with repr.
"""
from __future__ import annotations

import logging
import os

import pytest

from models.store import ImportModelError, import_model
from tests.models.test_import import folder, make_hf_folder, names, one_line_error, src  # noqa: F401

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX links and FIFOs")


@pytest.mark.parametrize("link, target", [
    ("home", "outside-folder"),      # a folder outside the source
    ("zero.bin.txt", "/dev/zero"),   # a device: endless bytes
    ("secret.json", "outside-file"),  # a file outside, perhaps not the user's to share
    ("again.json", "config.json"),   # even a link inside the folder
])
def test_a_folder_with_a_link_is_refused_and_nothing_is_copied(folder, src, tmp_path, link, target):  # noqa: F811
    model = make_hf_folder(src)
    (tmp_path / "outside-folder").mkdir()
    (tmp_path / "outside-folder" / "big.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "outside-file").write_text("private")
    dest = target if target.startswith("/") or target == "config.json" else str(tmp_path / target)
    (model / link).symlink_to(dest)
    message = one_line_error(import_model, model)
    assert "link" in message and repr(link) in message
    assert not folder.exists() or names(folder) == []


def test_a_fifo_in_a_folder_is_refused(folder, src):  # noqa: F811
    model = make_hf_folder(src)
    os.mkfifo(model / "pipe.json")
    message = one_line_error(import_model, model)
    assert "'pipe.json'" in message and "not a regular file" in message


def test_nested_regular_files_are_copied(folder, src):  # noqa: F811
    model = make_hf_folder(src)
    (model / "sub").mkdir()
    (model / "sub" / "notes.txt").write_text("kept")
    path = import_model(model)
    assert (path / "sub" / "notes.txt").read_text() == "kept"
    assert names(path) == ["config.json", "model.safetensors", "sub", "tokenizer.json"]


def test_a_newline_in_a_name_cannot_forge_a_log_line(folder, src, caplog):  # noqa: F811
    odd = src / "x\n2026-01-01 ERROR forged"
    odd.mkdir()
    model = make_hf_folder(odd)
    with caplog.at_level(logging.INFO, logger="models.store"):
        import_model(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "models.store"]
    assert lines and all("\n" not in line for line in lines)


def test_a_device_given_directly_is_refused(folder):  # noqa: F811
    with pytest.raises(ImportModelError, match="not a regular file"):
        import_model("/dev/zero")
