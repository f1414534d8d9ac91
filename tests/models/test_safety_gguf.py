"""models.safety's GGUF rules: the header scan refuses what would cost a reader too
much from the counts, before one item of a refused array is read, and its cost model holds
for the readers attnchat calls (measured in a child process).
"""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from models import safety
from models.safety.gguf_scan import (
    CHUNK,
    MAX_READER_BYTES,
    MAX_VOCAB,
    GGUFHeaderError,
    HeaderStats,
    scan_header,
)
from tests.models import gguf_files as g

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    return g.metadata_bomb_files(tmp_path_factory.mktemp("bombs"))


@pytest.mark.parametrize("name, words", [
    ("4x2^20-bytes", "'evil.a' is an array of 1,048,576 items; only a vocabulary may hold more than 4,096"),
    ("4x2^20-empty-strings", "'evil.a' is an array of 1,048,576 items; only a vocabulary may hold more than 4,096"),
    ("10000x400-items", "it declares 10,001 metadata keys (the limit is 4,096)"),
    ("4000x400-items", "its metadata arrays outside the vocabulary hold over 65,536 items (at 'evil.163')"),
])
def test_metadata_bombs_are_refused_from_their_counts(bombs, name, words):
    path = bombs[name]
    stats = HeaderStats()
    with pytest.raises(GGUFHeaderError) as e:
        scan_header(path, stats)
    assert str(e.value) == words
    assert stats.bytes_read <= CHUNK < path.stat().st_size  # one buffer of a 4-32 MB file
    with pytest.raises(safety.Refused) as r:
        safety.check_model(path)
    assert r.value.kind == "gguf" and str(r.value).startswith(f"{path.name} was refused: its header could not be "
                                                              f"read within attnchat's limits ({words})")


def test_a_vocabulary_past_the_limit_is_refused_before_its_strings_are_read(tmp_path):
    n = 1 << 19
    path = g.gguf(tmp_path / "v.gguf", g.ARCH, *g.vocabulary(n, scores=False, types=False))
    stats = HeaderStats()
    with pytest.raises(GGUFHeaderError, match=r"^'tokenizer.ggml.tokens' is an array of 524,288 items "
                                              r"\(the limit is 300,000\)$"):
        scan_header(path, stats)
    assert stats.bytes_read <= CHUNK < path.stat().st_size and stats.metadata_bytes < 64  # no token walked


@pytest.mark.parametrize("entries, words", [
    ([g.array_entry("tokenizer.ggml.tokens", g.STRING, 3, g.strings("abc")),
      g.array_entry("tokenizer.ggml.scores", g.F32, 2, struct.pack("<2f", 0, 0))],
     "'tokenizer.ggml.scores' holds 2 items for 3 tokens"),
    ([g.array_entry("tokenizer.ggml.tokens", g.I32, 3, struct.pack("<3i", 0, 1, 2))],
     "'tokenizer.ggml.tokens' holds numbers, not strings"),
    ([g.array_entry("tokenizer.ggml.token_type", g.I32, 1, struct.pack("<i", 1))],
     "'tokenizer.ggml.token_type' holds 1 items for 0 tokens"),
    ([g.array_entry("evil.nest", g.ARRAY, 2, struct.pack("<IQ", g.U8, 5000) + bytes(5000))],
     "'evil.nest' is an array of 5,000 items; only a vocabulary may hold more than 4,096"),
])
def test_vocabulary_arrays_must_agree(tmp_path, entries, words):
    with pytest.raises(GGUFHeaderError) as e:
        scan_header(g.gguf(tmp_path / "t.gguf", g.ARCH, *entries))
    assert str(e.value) == words


def test_the_reader_budget_refuses_a_vocabulary_with_a_million_merges(tmp_path):
    # 300,000 tokens with scores and types (~910 MB through gguf-py), then a merges header
    # of 2^20 strings: refused from that count, the file ends right after it.
    entries = g.vocabulary(MAX_VOCAB) + [g.key("tokenizer.ggml.merges") + struct.pack("<IIQ", g.ARRAY, g.STRING, 1 << 20)]
    path = g.gguf(tmp_path / "m.gguf", g.ARCH, *entries)
    stats = HeaderStats()
    with pytest.raises(GGUFHeaderError, match=r"^its metadata arrays would take a reader over 1,024 MiB "
                                              r"\(at 'tokenizer.ggml.merges', 1,048,576 items\)$"):
        scan_header(path, stats)
    assert MAX_READER_BYTES < stats.reader_bytes


def test_a_gemma_sized_vocabulary_passes(tmp_path):
    """Gemma 3's 262,144 tokens, scores and types: the largest vocabulary in the catalog."""
    stats = scan_header(g.gguf(tmp_path / "gemma.gguf", g.ARCH, *g.vocabulary(262_144)))
    assert stats.items == 3 * 262_144
    assert 780e6 < stats.reader_bytes < 0.8 * MAX_READER_BYTES  # gguf-py measured 726 MB on the real file


def test_the_default_model_passes(default_model_file):
    stats = safety.check_gguf(default_model_file)
    assert (stats.version, stats.tensors) == (3, 272)
    assert stats.items > 2 * 49_000 and stats.other_items < 100  # the vocabulary and its merges
    assert stats.reader_bytes < MAX_READER_BYTES // 4


_MEASURE = """
import sys
which, path = sys.argv[1], sys.argv[2]
if which == "gguf-py":
    import gguf
else:
    from transformers.integrations.gguf.reader import read_gguf_metadata
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
before = peak()
if which == "gguf-py":
    reader = gguf.GGUFReader(path)
else:
    metadata = read_gguf_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
print(peak() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM")
def test_the_cost_model_bounds_what_the_readers_take(tmp_path):
    """gguf-py's GGUFReader (transformers' tensor path) and transformers' own metadata reader
    (config, tokenizer) read a 20,000-token vocabulary with merges in a child: the peak
    memory each adds stays under the scan's estimate, and gguf-py's is within 2x of it (the
    estimate is what the budget counts)."""
    n = 20_000
    path = g.gguf(tmp_path / "voc.gguf", g.ARCH, *g.vocabulary(n, merges=n))
    estimate = scan_header(path).reader_bytes
    measured = {}
    for which in ("gguf-py", "transformers"):
        r = subprocess.run([sys.executable, "-c", _MEASURE, which, str(path)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        measured[which] = int(r.stdout)
    assert estimate / 2 < measured["gguf-py"] <= estimate, (estimate, measured)
    assert measured["transformers"] < estimate / 8, (estimate, measured)
