"""ggml's repacked forms of a weight's blocks (runtime/kernels/ggml_repack.py): the product from
a form equals the product from the plain blocks to float32 rounding, for one row and for a
prompt's rows; a form is made once and counted in the weight's memory; off, or for a type ggml
has no form of here, the plain blocks run; the one-graph token decodes through the forms."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from runtime import load_model
from runtime.errors import ModelFileChanged
from runtime.kernels import ggml_ops, ggml_repack, quantized
from runtime.kernels.ggml_graph import Graph
from runtime.model.ggml_layers import _blocks
from runtime.model.quant_layers import quant_layers
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.gguf.names import gguf_weights
from runtime.weights.quant_make import quantize
from runtime.weights.quant_types import BLOCK_TYPES
from runtime.weights.quant_weight import QuantWeight
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")


@pytest.fixture(autouse=True)
def forms_on(monkeypatch, tmp_path):
    """Every form ggml has here (by default only the types measured faster on this machine)."""
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "1")
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    ggml_repack._measured.cache_clear()
    yield
    ggml_repack._measured.cache_clear()

#: The types llama.cpp repacks on x86 (which of them ggml repacks depends on the CPU's features).
CANDIDATES = ("Q4_0", "Q4_K", "IQ4_NL", "Q8_0", "Q6_K", "Q5_K", "Q2_K")


def _weight(name: str, rows: int = 64, cols: int = 512, seed: int = 0) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    t = BLOCK_TYPES[name]
    return QuantWeight(torch.from_numpy(quantize(w, t)), t, rows, cols)


def _product(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """``x (M, cols) @ W.T`` by one ggml graph over :func:`_blocks` (a form where there is one)."""
    M = x.shape[0]
    graph = Graph(result_bytes=4 * M * w.rows + (1 << 16), max_nodes=8)
    y = graph.g.ggml_mul_mat(graph.ctx, _blocks(graph, w), graph.leaf(x, (w.cols, M)))
    graph.output(y)
    out = graph.torch_view(y, (M, w.rows))
    graph.compute()
    return out.clone()


def _with_forms() -> list[str]:
    return [n for n in CANDIDATES if ggml_repack.repacked(_weight(n)) is not None]


def test_some_type_has_a_form_on_this_cpu():
    """llama.cpp's x86 build repacks Q4_0 on any AVX2 CPU: every CPU CI runs on has one."""
    assert ggml_repack.enabled()
    assert "Q4_0" in _with_forms()


@pytest.mark.parametrize("name", CANDIDATES)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_the_forms_product_equals_the_plain_blocks(name, M, monkeypatch):
    w = _weight(name)
    x = torch.randn(M, w.cols, generator=torch.Generator().manual_seed(1))
    form = ggml_repack.repacked(w)
    got = _product(w, x)
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "0")
    plain = QuantWeight(w.raw, w.btype, w.rows, w.cols)
    want = _product(plain, x)
    assert "ggml-repack" not in plain.prepared
    if form is None:
        assert torch.equal(got, want)
    else:
        assert form.tensor.contents.data
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, err


def test_a_form_is_made_once_and_counted():
    names = _with_forms()
    w = _weight(names[0])
    before = w.extra_bytes
    form = ggml_repack.repacked(w)
    assert ggml_repack.repacked(w) is form
    assert w.extra_bytes == before + form.nbytes
    assert form.nbytes >= w.file_bytes


def test_off_and_unquantized_mean_the_plain_blocks(monkeypatch):
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "1")
    f32 = BLOCK_TYPES["F32"]
    w = QuantWeight(torch.zeros(8, 32 * 4, dtype=torch.uint8), f32, 8, 32)
    assert ggml_repack.repacked(w) is None
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "0")
    assert not ggml_repack.enabled() and not ggml_repack.enabled("Q4_0", BLOCK_TYPES["Q4_0"].ggml_type)
    assert ggml_repack.repacked(_weight("Q4_0")) is None


def test_unset_makes_forms_of_the_types_measured_faster_here(monkeypatch, tmp_path):
    """Unset, a type gets forms where its products ran faster on them on this machine (timed
    once, kept in the cache folder); nothing measured (``ATTNCHAT_KERNELS=default``): none."""
    from runtime.kernels import machine

    every = _with_forms()   # ATTNCHAT_GGML_REPACK=1: every type ggml has a form of here
    monkeypatch.delenv("ATTNCHAT_GGML_REPACK")
    monkeypatch.setattr(machine, "busy", lambda: False)
    monkeypatch.setattr(ggml_repack, "time_forms", lambda t: {"blocks": 100.0, "form": 50.0 if t == 2 else 99.0})
    assert "Q4_0" in every and _with_forms() == ["Q4_0"]   # Q4_0 (ggml type 2) 2x faster; the rest < MARGIN
    kept = json.loads(machine.kernel_file(tmp_path / "cache").read_text())["repack"]
    assert kept["Q4_0"]["on"] and not any(v["on"] for k, v in kept.items() if k != "Q4_0")
    ggml_repack._measured.cache_clear()
    monkeypatch.setattr(ggml_repack, "time_forms", lambda t: pytest.fail("a kept choice is timed again"))
    assert _with_forms() == ["Q4_0"]
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    assert _with_forms() == []
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "0")
    assert _with_forms() == []


def test_the_timing_compares_the_same_products_on_forms_and_blocks():
    t = BLOCK_TYPES["Q4_0"]
    times = ggml_repack.time_forms(t.ggml_type, reps=1)
    assert set(times) == {"blocks", "form"} and all(0 < v < 1e6 for v in times.values())
    assert ggml_repack.time_forms(BLOCK_TYPES["Q4_1"].ggml_type, reps=1) is None   # ggml has no Q4_1 form


def test_a_form_replaces_blocks_read_from_a_file(tmp_path):
    """A part read from a file (its blocks can be read again): the form made, the ggml product
    prepared on the blocks moves to it (equal to float32 rounding), the blocks leave memory and
    count 0, and what still reads them (widen, a lookup) reads the file's, bit for bit."""
    path = make_tiny_gguf(tmp_path, matrix_type="Q4_0", embed_type="Q8_0")
    g = read_gguf_tensors(path)
    md = g.metadata
    w = gguf_weights(g, md["llama.block_count"], md["llama.attention.head_count"], md["llama.attention.head_count_kv"])
    p = w.matrices["blocks.0.mlp.gate_up_proj"][0]
    plain = QuantWeight(p.raw.clone(), p.btype, p.rows, p.cols)
    x = torch.randn(5, p.cols, generator=torch.Generator().manual_seed(2))
    m = quantized.prepared(p, "ggml")   # as set_choice prepares it, before any graph
    want = m(x).clone()
    form = ggml_repack.repacked(p)
    assert form is not None
    assert not p.resident and p.resident_bytes == 0 and p.extra_bytes == form.nbytes >= p.file_bytes
    assert m.raw is None and m.form is form
    err = (m(x) - want).abs().max().item() / want.abs().max().item()
    assert 0 < err < 1e-5 or torch.equal(m(x), want), err
    assert torch.equal(quantized.widen(p), quantized.widen(plain))
    assert torch.equal(quantized.widen(p, rows=slice(3, 40)), quantized.widen(plain, rows=slice(3, 40)))
    ids = torch.tensor([[1, 7], [0, 3]])
    assert torch.equal(quantized.lookup(p, ids), quantized.lookup(plain, ids))
    assert torch.equal(p.dequantized(), plain.dequantized())
    assert ggml_repack.repacked(p) is form and not p.resident


def test_the_one_graph_token_decodes_through_the_forms(tmp_path, monkeypatch):
    """A tiny Q4_0 file: the one-graph token's logits with the forms equal the same file's
    without them to rounding, and pick the same tokens; the blocks the forms replaced left
    memory (the model's bytes say so) and a prompt after them reads them from the file (as
    the plain run's to rounding); the file cut short then refuses the prompt in one error."""
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    path = make_tiny_gguf(tmp_path, tokenizer=tiny_tokenizer_metadata(), matrix_type="Q4_0", embed_type="Q8_0")

    def run():
        m = load_model(path, device="cpu", threads=1)
        assert m.decode_mode == "ggml"
        cache = m.new_cache(64, dtype="float32")
        rows, tok = [], 5
        with torch.inference_mode():
            m.logits([5, 9, 33, 40], cache, last_only=True)
            for _ in range(6):
                logits = m.decode_next(tok, cache)[0, -1].clone()
                rows.append(logits)
                tok = int(logits.argmax())
            rows.append(m.logits([7, 8, 61], cache, last_only=True)[0, -1].clone())   # prefill: widen
        parts = [p for layer in m.decoder.blocks for p in (*layer.mlp.down_proj.parts, *layer.attn.qkv_proj.parts)]
        return torch.stack(rows), parts, m

    with_forms, parts, m = run()
    assert all(p.prepared.get("ggml-repack") is not None and not p.resident for p in parts)
    every = {id(p): p for layer in quant_layers(m.decoder) for p in layer.parts}.values()
    forms_bytes, dropped = m.weights_bytes, sum(p.file_bytes for p in every if not p.resident)
    formed = sum(p.extra_bytes for p in every)
    monkeypatch.setenv("ATTNCHAT_GGML_REPACK", "0")
    plain, parts, m0 = run()
    assert all("ggml-repack" not in p.prepared and p.resident for p in parts)
    assert torch.equal(with_forms.argmax(-1), plain.argmax(-1))
    assert (with_forms - plain).abs().max().item() <= 1e-4 * plain.abs().max().item()
    assert dropped > 0 and formed >= dropped
    assert forms_bytes == m0.weights_bytes - dropped + formed   # the forms counted, the blocks they replaced not
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ModelFileChanged, match="changed on disk"), torch.inference_mode():
        m.logits([7, 8, 61], m.new_cache(64, dtype="float32"), last_only=True)


def test_a_devices_blocks_get_no_form(monkeypatch):
    """The device branch (blocks off the CPU), taken here on CPU tensors as the kernels' tests do."""
    from runtime.kernels import quantized

    monkeypatch.setattr(quantized, "torch_ops", True)
    w = _weight("Q4_0")
    assert ggml_repack.repacked(w) is None and "ggml-repack" not in w.prepared
