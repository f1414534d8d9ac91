"""A weight's blocks read again from its GGUF file (runtime/weights/block_source.py): every part
of a tiny llama file (its fused q/k/v with the q/k rows un-permuted, gate/up, the embedding)
reads back as the blocks read at load, whole, by rows and by ids, after its blocks left memory;
its memory then counts 0; a file cut short, modified or replaced says so in one error."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from runtime.errors import ModelFileChanged
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.gguf.names import gguf_weights
from runtime.weights.quant_types import BLOCK_TYPES
from runtime.weights.quant_weight import QuantWeight
from tests.runtime.tiny_gguf import make_tiny_gguf


def _weights(path):
    g = read_gguf_tensors(path)
    md = g.metadata
    w = gguf_weights(g, md["llama.block_count"], md["llama.attention.head_count"], md["llama.attention.head_count_kv"])
    return w, [p for parts in w.matrices.values() for p in parts] + [w.embed]


def test_every_part_reads_back_as_its_blocks(tmp_path):
    path = make_tiny_gguf(tmp_path, matrix_type="Q4_K", embed_type="Q6_K")
    w, parts = _weights(path)
    assert len(w.matrices["blocks.0.attn.qkv_proj"]) == 1   # q, k and v fused: three segments, q/k permuted
    assert [s.perm is not None for s in w.matrices["blocks.0.attn.qkv_proj"][0].source.segments] == [True, True, False]
    ids = torch.tensor([3, 0, 17, 3])
    for p in parts:
        blocks = p.raw.clone()
        assert torch.equal(p.source.read(), blocks)
        assert p.drop_blocks() == blocks.numel()
        assert not p.resident and p.resident_bytes == 0 and p.file_bytes == blocks.numel()
        assert torch.equal(p.raw, blocks)
        assert torch.equal(p.blocks(slice(5, 21)), blocks[5:21])
        assert torch.equal(p.blocks(slice(0, p.rows)), blocks)
        buf = torch.empty(blocks.numel() + 64, dtype=torch.uint8)
        assert torch.equal(p.blocks(slice(2, 9), out=buf), blocks[2:9])
        assert torch.equal(p.take(ids), blocks[ids])
        assert p.drop_blocks() == 0
    assert w.nbytes == sum(t.numel() * 4 for t in w.floats.values())   # no block in memory


def test_blocks_without_a_file_stay():
    t = BLOCK_TYPES["Q8_0"]
    p = QuantWeight(torch.zeros(4, t.row_bytes(64), dtype=torch.uint8), t, 4, 64)
    assert p.drop_blocks() == 0 and p.resident and p.resident_bytes == p.file_bytes


def test_blocks_off_the_cpu_stay(tmp_path):
    """Blocks moved to another device (the meta device stands for a GPU) are not the file's
    memory map: they stay, although the file could give them again."""
    path = make_tiny_gguf(tmp_path, matrix_type="Q4_K", embed_type="Q6_K")
    _, parts = _weights(path)
    p = parts[0]
    p.raw = p.raw.to("meta")
    assert p.source is not None and p.drop_blocks() == 0 and p.resident


def test_a_changed_file_says_so(tmp_path):
    path = make_tiny_gguf(tmp_path)
    _, parts = _weights(path)
    a, b = parts[0], parts[1]
    want = a.raw.clone()
    for p in parts:   # none a view of the file's map any more: the cut below cannot reach one
        p.drop_blocks()
    assert torch.equal(a.blocks(), want)   # the descriptor opens here
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelFileChanged, match="changed on disk"):
        a.blocks()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert torch.equal(a.blocks(), want)
    os.truncate(path, 1000)   # cut short: an error, not SIGBUS
    with pytest.raises(ModelFileChanged, match="changed on disk: reload it"):
        b.blocks(slice(0, 1))


def test_a_replaced_file_is_read_as_loaded_or_refused(tmp_path):
    path = make_tiny_gguf(tmp_path)
    other = make_tiny_gguf(tmp_path, "other.gguf", seed=1)
    _, parts = _weights(path)
    want = parts[0].raw.clone()
    for p in parts:
        p.drop_blocks()
    assert torch.equal(parts[0].blocks(), want)
    spare = tmp_path / "spare.gguf"
    shutil.copy(other, spare)
    os.replace(other, path)   # the open descriptor still reads the file as loaded
    assert torch.equal(parts[0].blocks(), want)

    path2 = make_tiny_gguf(tmp_path, "third.gguf")
    _, parts2 = _weights(path2)
    for p in parts2:
        p.drop_blocks()
    os.replace(spare, path2)   # replaced before the first read: refused
    with pytest.raises(ModelFileChanged, match="another file is in its place"):
        parts2[0].blocks()
