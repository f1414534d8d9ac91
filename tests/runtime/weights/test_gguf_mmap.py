"""Reading a GGUF's tensors as memory-mapped blocks (runtime.weights.gguf.mmap), checked
against gguf-py's GGUFReader on tiny generated files."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from models.safety.gguf_scan import GGUFHeaderError, scan_header
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.gguf.write import tokenizer_metadata
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), overrides=EVERY_TYPE, embed_type="Q4_K")


def test_tensor_table_equals_gguf_reader(tiny):
    ours = read_gguf_tensors(tiny)
    ref = GGUFReader(str(tiny))
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
        np.testing.assert_array_equal(ours.raw(t.name).numpy().reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    types = {int(t.tensor_type) for t in ref.tensors}
    assert len(types) == 9  # F32 norms, the Q4_K embedding and the 7 of EVERY_TYPE


def test_metadata_scalars_and_arrays(tiny):
    g = read_gguf_tensors(tiny)
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.block_count"] == 2 and g.metadata["llama.embedding_length"] == 256
    assert g.alignment == 32 and g.data_offset % 32 == 0


def test_tokenizer_arrays_read_whole(tmp_path, default_model_file):
    tok = tokenizer_metadata(default_model_file)
    assert len(tok["tokenizer.ggml.tokens"]) == 49152 and tok["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert tok["tokenizer.ggml.token_type"].shape == (49152,)
    path = make_tiny_gguf(tmp_path, tokenizer=tok)
    again = read_gguf_tensors(path, arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    assert again.metadata["tokenizer.ggml.tokens"] == tok["tokenizer.ggml.tokens"]
    assert again.metadata["tokenizer.ggml.merges"] == tok["tokenizer.ggml.merges"]
    assert again.tensors["token_embd.weight"].shape == (49152, 256)


def test_tensors_are_pages_of_the_file_not_copies(tiny):
    g = read_gguf_tensors(tiny)
    raw = g.raw("blk.0.ffn_up.weight")
    base = g.mapped()
    assert raw.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert raw.data_ptr() - base.data_ptr() == g.tensors["blk.0.ffn_up.weight"].offset


def test_truncated_file_is_refused(tiny, tmp_path):
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFHeaderError, match="outside the file"):
        read_gguf_tensors(cut)
    cut.write_bytes(data[:200])
    with pytest.raises(GGUFHeaderError, match="truncated"):
        read_gguf_tensors(cut)


def _header(magic: bytes = b"GGUF", version: int = 3, tensors: int = 0, keys: int = 0, name: int = 0) -> bytes:
    return magic + struct.pack("<IQQ", version, tensors, keys) + struct.pack("<Q", name) + bytes(64)


@pytest.mark.parametrize("head, words", [
    (_header(magic=b"GGUX"), "no GGUF header"),
    (_header(version=4), "GGUF version 4 is not supported (2 or 3)"),
    (_header(tensors=100_001), "it declares 100,001 tensors (the limit is 100,000)"),
    (_header(keys=4_097), "it declares 4,097 metadata keys (the limit is 4,096)"),
    (_header(keys=1, name=2_000), "metadata key 0 has a name of 2,000 bytes"),
    (_header(tensors=1, name=5_000), "tensor 0 has a name of 5,000 bytes"),
])
def test_header_refused_as_the_scan_refuses_it(tmp_path, head, words):
    """The tensor reader walks the header's start with the scan's own reader (models.safety.gguf_scan):
    the same refusal, word for word (the scan reads no tensor names)."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(head)
    with pytest.raises(GGUFHeaderError) as e:
        read_gguf_tensors(path)
    assert str(e.value) == words
    if not words.startswith("tensor 0"):
        with pytest.raises(GGUFHeaderError) as e:
            scan_header(path)
        assert str(e.value) == words
