"""What the README says about the catalog, checked against the catalog itself (a sentence
that said "ten small instruct models" went stale once an eleventh, completion-only one came).
Stdlib and models only: no torch."""
from __future__ import annotations

import re
from pathlib import Path

import models
from models.sizes import size_text

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_catalog_sentence_matches_the_catalog():
    said = re.search(r"The catalog \(`models list`\) holds (\d+) models beside the default one, (\S+ \S+) to "
                     r"(\S+ \S+) to download: (\d+) chat models and (.+?), which only continues text", _flat(README))
    assert said, "the README's catalog sentence is gone or reworded: update this test with it"
    others = [e for e in models.CATALOG if e.id != models.DEFAULT_MODEL.id]
    sizes = sorted(e.size_bytes for e in others)
    chat = [e for e in others if e.chat_template]
    completion = [e.name for e in others if not e.chat_template]
    assert said.groups() == (str(len(others)), size_text(sizes[0]), size_text(sizes[-1]), str(len(chat)),
                             " and ".join(completion))
    assert len(others) == 11 and said.group(2, 3) == ("241.4 MiB", "4.4 GiB")  # what `models list` prints


def test_the_default_models_size_is_the_one_models_list_prints():
    size = size_text(models.DEFAULT_MODEL.size_bytes)
    assert size == "93.8 MiB"
    assert f"GGUF Q4_1, {size})" in _flat(README) and f"{size} default" in _flat(README)
    assert " MB" not in _flat(README), "sizes in the README are binary (MiB), as on the command line"


def test_size_text_units():
    assert [size_text(n) for n in (0, 1023, 1024, 100_000, 2**20, 1_060_000_000, 4_700_000_000)] == [
        "0 B", "1,023 B", "1.0 KiB", "97.7 KiB", "1.0 MiB", "1,010.9 MiB", "4.4 GiB"]


def test_the_servers_example_startup_line_has_the_default_pool():
    """docs/server.md's example startup line said a 360 MiB pool (the float32 cache's one
    conversation) after the default model's cache went float16: serve prints 256 MiB."""
    server_md = _flat((Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text(encoding="utf-8"))
    one_conversation = 8192 * 2 * 30 * 3 * 64 * 2  # float16, the default model's shape
    pool_mib = max(256 << 20, one_conversation) >> 20  # batching.plan: max(POOL_BYTES, one whole conversation)
    assert pool_mib == 256 and one_conversation >> 20 == 180
    said = re.search(r"`attnchat: 4 replies decode together \(continuous batching over a (\d+) MiB paged KV cache: "
                     r"room for (\d+) whole 8192-token conversation\)", server_md)
    assert said and said.groups() == (str(pool_mib), str((256 << 20) // one_conversation))
