"""Files of the block types only ggml's kernels run (Q2_K, Q3_K, IQ1-IQ4, TQ, MXFP4, NVFP4,
Q1_0): two tiny generated GGUFs hold one type per matrix kind each. They load from their
blocks and answer through ggml's kernels; without ggml they run from float16 copies (the
cost said) or are refused before a weight is read; a type attnchat does not run is refused
from the header, naming the tensor.

Truth is the float32 run of the same file (its blocks dequantized exactly by ggml's
``to_float``, bitwise gguf.quants: tests/runtime/weights/test_ggml_types.py).
"""
from __future__ import annotations

import logging
import struct

import pytest
import torch

from runtime import load_model
from runtime.errors import UnsupportedModelError
from runtime.kernels import ggml_ops
from runtime.model import quant_layers
from runtime.weights.gguf import open as gguf_open
from tests.runtime.tiny_gguf import GGML_ONLY_TYPES, make_tiny_gguf, tiny_tokenizer_metadata

IDS = list(range(4, 40)) + [7, 9, 11]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    tok = tiny_tokenizer_metadata()
    return [make_tiny_gguf(folder, f"ggml-only-{i}.gguf", tokenizer=tok, overrides=ov, embed_type=embed, seed=i)
            for i, (ov, embed) in enumerate(GGML_ONLY_TYPES)]


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    return tmp_path / "cache"


def _decode(model, ids, n: int) -> torch.Tensor:
    """Teacher-forced decode logits ``(n, V)`` after a prefill of ``ids[:-n]``."""
    cache = model.new_cache(len(ids) + 1)
    model.logits(ids[:-n], cache)
    return torch.stack([model.decode_next(t, cache)[0, -1].clone() for t in ids[-n:]])


def _types(path) -> set[str]:
    from runtime.weights.quant_types import BY_ID

    g = gguf_open.open_gguf(path)
    return {BY_ID[i.ggml_type].name for i in g.tensors.values() if len(i.shape) == 2}


@pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")
@pytest.mark.parametrize("which", [0, 1])
def test_every_type_answers_through_ggml(files, env, which):
    path = files[which]
    q = load_model(path, device="cpu")
    f = load_model(path, device="cpu", dtype="float32")
    types = _types(path)
    assert len(types) == 8
    assert {t: q.quant_kernels.kernels[t][0] for t in types} == dict.fromkeys(types, "ggml")
    parts = {id(p): p for m in quant_layers.quant_layers(q.decoder) for p in m.parts}.values()
    assert all(p.extra_bytes == 0 for p in parts)  # the blocks themselves: no copy beside them
    assert q.weights_bytes <= path.stat().st_size < f.weights_bytes / 4
    with torch.inference_mode():
        torch.testing.assert_close(q.logits(IDS), f.logits(IDS), rtol=0, atol=0)  # prefill widens: exact
        dq, df = _decode(q, IDS, 8), _decode(f, IDS, 8)
    # ggml rounds a decode step's activations per block (llama.cpp's arithmetic)
    assert (dq - df).abs().mean() < 0.05
    assert (dq.argmax(-1) == df.argmax(-1)).float().mean() >= 0.75
    assert not [p for p in env.rglob("*.safetensors")]  # nothing full-precision on disk


def _no_ggml(monkeypatch):
    monkeypatch.setitem(ggml_ops._STATE, "why", "turned off for a test")
    monkeypatch.delitem(ggml_ops._STATE, "ggml", raising=False)


def test_without_ggml_float16_copies_with_their_cost_said(files, env, monkeypatch, caplog):
    path = files[0]
    ref = load_model(path, device="cpu", dtype="float32")
    _no_ggml(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="runtime.loader.load"):
        q = load_model(path, device="cpu")
    types = _types(path)
    assert {t: q.quant_kernels.kernels[t] for t in types} == dict.fromkeys(types, ("f16", "f16"))
    parts = {id(p): p for m in quant_layers.quant_layers(q.decoder) for p in m.parts}.values()
    extra = sum(p.extra_bytes for p in parts)
    assert extra == sum(p.rows * p.cols * 2 for p in parts)
    said = [r.getMessage() for r in caplog.records if "copies beside the file's blocks" in r.getMessage()]
    assert len(said) == 1 and f"{extra / 1e6:.0f} MB more memory" in said[0], said
    with torch.inference_mode():
        a, b = q.logits(IDS), ref.logits(IDS)
    assert (a - b).abs().mean() < 0.025 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_without_ggml_a_type_only_ggml_decodes_is_refused_before_any_weight(files, env, monkeypatch):
    _no_ggml(monkeypatch)
    monkeypatch.setattr(gguf_open, "blocks", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(UnsupportedModelError, match=r"ggml-only-1.gguf: tensor 'token_embd.weight' is Q1_0, which "
                       r"only ggml's kernels decode, and ggml does not load here \(turned off for a test\)"):
        load_model(files[1], device="cpu")


def _retyped(src, dst, tensor: str, new_type: int):
    """A copy of the GGUF ``src`` with ``tensor``'s type id in its tensor table set to ``new_type``."""
    g = gguf_open.open_gguf(src)
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name, 0, g.data_offset) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("new_type, said", [(15, "is Q8_K, a block type attnchat does not run"),
                                            (99, "has block type 99, which this version does not know")])
def test_a_type_attnchat_does_not_run_is_refused_from_the_header(files, env, tmp_path, new_type, said):
    bad = _retyped(files[0], tmp_path / "bad.gguf", "token_embd.weight", new_type)
    with pytest.raises(UnsupportedModelError, match=f"bad.gguf: tensor 'token_embd.weight' {said}.*pick another quant"):
        gguf_open.open_gguf(bad)
    with pytest.raises(UnsupportedModelError, match="token_embd.weight"):
        load_model(bad, device="cpu")
    # refused before anything of it was kept (the source's header, kept when _retyped opened it, is all)
    from runtime.weights import checked

    kept = {p for p in env.rglob("*") if p.is_file()} if env.exists() else set()
    assert kept <= {checked.beside(files[0], "header")} and not checked.beside(bad, "header").exists()


def test_a_codebook_embedding_on_a_device_is_a_float16_table(files):
    """Off the CPU (``torch_decode``, what a GPU runs, passed here) an embedding of a type with
    no torch decoding (IQ3_S) is widened once to float16 on the device: a CUDA graph captures
    an index, not a host round trip."""
    from runtime.model.quant_layers import QuantEmbedding
    from runtime.weights.quant_types import block_type
    from runtime.weights.quant_weight import QuantWeight

    g = gguf_open.open_gguf(files[0])
    info = g.tensors["token_embd.weight"]
    embed = QuantEmbedding(QuantWeight(g.raw("token_embd.weight"), block_type(info.ggml_type), *info.shape))
    assert embed.weight_q.btype.name == "IQ3_S"
    ids = torch.tensor([[3, 17, 250], [0, 1, 319]])
    with torch.inference_mode():
        rows = embed(ids)
        embed.to_device("cpu", torch_decode=True)
        torch.testing.assert_close(embed(ids), rows.half().float(), rtol=0, atol=0)
    assert embed.nbytes == info.nbytes + info.shape[0] * info.shape[1] * 2
