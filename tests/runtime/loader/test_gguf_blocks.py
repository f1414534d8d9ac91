"""A quantized GGUF runs from its own blocks by default: tiny generated files for
the loader's paths, the real default model for the answers and the memory.

Truth is the float32 run of the same file (``dtype="float32"``: its blocks dequantized
exactly, float32 arithmetic), itself checked against transformers (test_default_model).
"""
from __future__ import annotations

import os

import pytest
import torch

import runtime
from runtime import load_model
from runtime.kernels import ggml_ops
from runtime.model import quant_layers
from runtime.model.quant_layers import QuantEmbedding, QuantLinear
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE,
                          embed_type="Q4_K")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny(tiny_file, cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(cache_dir))
    mp.setenv("ATTNCHAT_KERNELS", "default")
    try:
        yield load_model(tiny_file, device="cpu"), load_model(tiny_file, device="cpu", dtype="float32")
    finally:
        mp.undo()


IDS = list(range(4, 40)) + [7, 9, 11]


def _decode(model, ids, n: int, dtype: str | None = None) -> torch.Tensor:
    """Teacher-forced decode logits ``(n, V)`` after a prefill of ``ids[:-n]`` (a cache of ``dtype``,
    default the model's)."""
    cache = model.new_cache(len(ids) + 1, dtype=dtype)
    model.logits(ids[:-n], cache)
    return torch.stack([model.decode_next(t, cache)[0, -1].clone() for t in ids[-n:]])


def test_default_is_the_files_blocks(tiny, tiny_file, cache_dir):
    q, f = tiny
    assert q.dtype == "Q4_K_M" and q.compute_dtype == torch.float32 and f.dtype == torch.float32
    # the blocks' KV cache is float16 by default (ggml's attention reads it in place), float weights' float32
    assert (q.new_cache(8).dtype, f.new_cache(8).dtype) == (torch.float16, torch.float32)
    assert q.new_cache(8, dtype="float32").dtype == torch.float32   # asked for, given
    assert isinstance(q.decoder.embed, QuantEmbedding) and q.decoder.lm_head is None
    layers = quant_layers.quant_layers(q.decoder)
    assert len(layers) == 2 * 4 + 1 and all(isinstance(m, QuantLinear) for m in layers)
    assert not [m for m in q.decoder.modules() if isinstance(m, torch.nn.Linear)]  # no float matrix left
    # memory: the file's blocks in memory (a tied head counted once), what the kernels made
    # beside or in place of them, and the float32 norms
    parts = {id(p): p for layer in layers for p in layer.parts}.values()
    norms = sum(p.numel() * 4 for p in q.decoder.parameters())
    assert q.weights_bytes == sum(p.resident_bytes + p.extra_bytes for p in parts) + norms
    if ggml_ops.available():  # ggml reads the blocks themselves, or its repacked form in their place
        for p in parts:
            form = p.prepared.get("ggml-repack")
            assert p.extra_bytes == (0 if form is None else form.nbytes) and p.resident == (form is None), p
        assert q.weights_bytes <= tiny_file.stat().st_size < f.weights_bytes / 4
    else:  # torch's fallback (said once): 4-bit types repacked for int4pack, the others as float16 copies
        for p in parts:
            kernels = set(q.quant_kernels.kernels[p.btype.name])
            if kernels == {"f16"}:
                assert p.extra_bytes == p.rows * p.cols * 2, p
            else:
                assert kernels == {"int4pack-bf16"} and 0 < p.extra_bytes < p.rows * p.cols, p
        assert tiny_file.stat().st_size < q.weights_bytes < f.weights_bytes
    # nothing full-precision on disk: the cache folder holds config and tokenizer only
    written = [p.name for p in cache_dir.rglob("*") if p.is_file()]
    assert not [n for n in written if n.endswith(".safetensors")], written


def test_prefill_equals_float32_and_decode_is_close(tiny):
    q, f = tiny
    with torch.inference_mode():
        pq, pf = q.logits(IDS, q.new_cache(len(IDS), dtype="float32")), f.logits(IDS)
        p16 = q.logits(IDS)   # the blocks' default float16 cache: keys and values rounded
        dq, df = _decode(q, IDS, 12, "float32"), _decode(f, IDS, 12)
        d16 = _decode(q, IDS, 12)
    assert q.new_cache(1).dtype == torch.float16
    # the float16 cache's rounding is below the decode's own (greedy agreement on the real
    # model: tests/runtime/loader/test_default_answers.py, docs/benchmarks.md)
    assert (d16 - dq).abs().mean() < (dq - df).abs().mean()
    assert (p16 - pf).abs().mean() < 0.01 and (p16.argmax(-1) == pf.argmax(-1)).float().mean() >= 0.9
    if ggml_ops.available():
        torch.testing.assert_close(pq, pf, rtol=0, atol=0)  # prefill widens the blocks: exact float32
    else:  # torch's fallback rounds prefill too (float16 copies, int4pack's bfloat16 activations):
        # measured mean |difference| 0.012 (max 0.084, logits ~1.3) without ggml, Intel Xeon
        assert (pq - pf).abs().mean() < 0.025 and (pq.argmax(-1) == pf.argmax(-1)).float().mean() >= 0.9
    # ggml rounds a decode step's activations per block of 32 (llama.cpp's arithmetic);
    # measured mean |difference| 0.004 on these random weights
    assert (dq - df).abs().mean() < 0.05
    assert (dq.argmax(-1) == df.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("mode", ["static", "compile"])
def test_static_and_compiled_steps_equal_eager(tiny_file, cache_dir, monkeypatch, mode):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    eager = load_model(tiny_file, device="cpu", decode="eager", threads=1)
    other = load_model(tiny_file, device="cpu", decode=mode, threads=1)
    with torch.inference_mode():
        a, b = _decode(eager, IDS, 6), _decode(other, IDS, 6)
    if mode == "compile":  # the compiled step compiles in the background: eager until ready
        other.prepare_decode(background=False)
        with torch.inference_mode():
            b = _decode(other, IDS, 6)
        assert other.decode_state == "compile: ready"
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_the_gpu_paths_on_the_cpu(tiny, monkeypatch):
    """What a GPU runs, by argument on the CPU: the embedding decoded by torch ops on its
    device (a CUDA graph captures them), tinygemm's operands (test_quantized), the choice."""
    from runtime.kernels.quant_choice import default_quant_choice
    from runtime.weights.quant_types import BLOCK_TYPES

    q, f = tiny
    ids = torch.tensor([[3, 17, 250]])
    with torch.inference_mode():
        cpu_rows = q.decoder.embed(ids)
        try:
            q.decoder.embed.to_device("cpu", torch_decode=True)
            torch.testing.assert_close(q.decoder.embed(ids), cpu_rows, rtol=0, atol=0)
        finally:
            q.decoder.embed.to_device("cpu")
    choice = default_quant_choice({BLOCK_TYPES[n] for n in ("Q4_0", "Q4_K", "Q8_0", "Q6_K")}, "cuda")
    assert choice.kernels["Q4_K"] == ("int4pack-cuda", "int4pack-cuda") and choice.kernels["Q8_0"] == ("f16", "f16")


def test_embedding_blocks_to_a_device_on_the_cpu(tiny_file, monkeypatch):
    """``to_device`` keeps the CPU's blocks (the file's memory map) as they are; with
    ``torch_decode`` it copies them as a move to a GPU does, and the rows decoded from the
    copy by torch ops equal ggml's / torch's from the file."""
    from runtime.weights.gguf.mmap import read_gguf_tensors
    from runtime.weights.quant_types import block_type
    from runtime.weights.quant_weight import QuantWeight

    g = read_gguf_tensors(tiny_file)
    info, raw = g.tensors["token_embd.weight"], g.raw("token_embd.weight")
    embed = QuantEmbedding(QuantWeight(raw, block_type(info.ggml_type), *info.shape))
    ids = torch.tensor([[3, 17, 250], [0, 1, 319]])
    with torch.inference_mode():
        rows = embed(ids)
        embed.to_device("cpu")
        assert embed.weight_q.raw is raw and not embed.torch_decode
        embed.to_device("cpu", torch_decode=True)
        assert embed.torch_decode
        moved = embed.weight_q.raw
        assert moved.data_ptr() != raw.data_ptr() and torch.equal(moved, raw)
        torch.testing.assert_close(embed(ids), rows, rtol=0, atol=0)


def test_explain_sees_an_ordinary_linear_layer(tiny):
    """Gradients (the attribution view) go through the dequantized matrices."""
    q, _ = tiny
    layer = q.decoder.blocks[0].attn.qkv_proj
    x = torch.randn(1, 2, layer.in_features, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad[0, 0], layer.dequantized().sum(0), rtol=1e-5, atol=1e-5)


def test_widened_dtypes_and_int8(tiny_file, cache_dir, monkeypatch, tiny):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(cache_dir))
    _, f = tiny
    m16 = load_model(tiny_file, device="cpu", dtype="float16")
    m8 = load_model(tiny_file, device="cpu", dtype="int8")
    assert m16.dtype == torch.float16 and m8.dtype == torch.int8
    with torch.inference_mode():
        ref = f.logits(IDS)
        for m, tol in ((m16, 0.05), (m8, 0.3)):
            assert (m.logits(IDS) - ref).abs().mean() < tol
    g = load_model(tiny_file, device="cpu", dtype="gguf")
    assert g.dtype == "Q4_K_M"


@pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")
def test_the_head_keeps_its_activations(tiny):
    """The LM head runs ggml with its top logits without the activation rounding (runtime.kernels.quant_choice.head_choice)."""
    q, _ = tiny
    head = quant_layers.quant_layers(q.decoder)[-1]
    assert [r[3] for r in head._runs[0]] == ["ggml-head"]
    assert all(r[3] == "ggml" for layer in quant_layers.quant_layers(q.decoder)[:-1] for r in layer._runs[0])


@pytest.mark.slow
def test_default_model_from_its_blocks(default_model_file, default_model):
    """The real default model: Paris, >= 98 % teacher-forced decode agreement with float32
    (measured 98.2 % on an Intel Xeon; llama.cpp 96.6 % on the same file),
    the file's bytes as its weights."""
    from runtime.generate.chat_format import Message, encode_messages

    q = load_model(default_model_file, device="cpu")
    assert q.dtype == "Q4_1"
    parts = {id(p): p for layer in quant_layers.quant_layers(q.decoder) for p in layer.parts}.values()
    assert sum(p.file_bytes for p in parts) < os.path.getsize(default_model_file)  # the blocks, no copy
    norms = sum(p.numel() * 4 for p in q.decoder.parameters())
    assert q.weights_bytes == sum(p.file_bytes + p.extra_bytes for p in parts) + norms
    ids = encode_messages(q.tokenizer, [Message("user", "What is the capital of France?")])
    with torch.inference_mode():
        cache = q.new_cache(64)
        # the default float16 cache, as the planner plans it for this file
        assert cache.dtype == torch.float16 and cache.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
        planned = runtime.plan(layers=30, kv_heads=3, head_dim=64, context=64,
                               blocks=runtime.gguf_blocks_bytes(default_model_file))
        assert (planned.cache_dtype, planned.kv_bytes_per_token) == ("float16", 23_040)
        logits, out = q.logits(ids, cache, last_only=True), []
        for _ in range(10):
            out.append(int(logits[0, -1].argmax()))
            logits = q.decode_next(out[-1], cache)
        assert "Paris" in q.decode(out)
        text = q.encode("The history of the printing press begins in the fifteenth century, when Johannes "
                        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. " * 3)
        dq, df = _decode(q, text, len(text) - 8), _decode(default_model, text, len(text) - 8)
    assert (dq.argmax(-1) == df.argmax(-1)).float().mean() >= 0.95


def test_float_copies_an_earlier_version_kept_are_deleted(tiny_file, cache_dir, monkeypatch):
    """Earlier versions converted every GGUF to float and kept it (544 MB-1 GB for Gemma 3 270M):
    a file that runs from its blocks never reads those, so loading it deletes them."""
    from runtime.weights.gguf.converted import gguf_cache_dir

    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(cache_dir))
    folder = gguf_cache_dir(tiny_file)
    folder.mkdir(parents=True, exist_ok=True)
    stale = [folder / "decoder-v1-float32.safetensors", folder / "decoder-v1-float16.safetensors"]
    for f in stale:
        f.write_bytes(b"\0" * 4096)
    kept = sorted(p.name for p in folder.iterdir() if p not in stale)
    g = load_model(tiny_file, device="cpu")
    assert g.dtype == "Q4_K_M" and not any(f.exists() for f in stale)
    assert sorted(p.name for p in folder.iterdir()) == kept   # config and tokenizer stay


def test_the_default_cache_dtype_per_device_and_weights():
    """float16 for a GGUF's blocks on the CPU; elsewhere the compute dtype (a GPU's float16
    weights: float16; bfloat16 weights: float32), so a device this machine lacks plans right."""
    assert runtime.default_cache_dtype("cpu", "float16", blocks=True) == torch.float16
    assert runtime.default_cache_dtype("cpu", "float16") == torch.float32
    assert runtime.default_cache_dtype("cpu", "bfloat16") == torch.float32
    assert runtime.default_cache_dtype("cuda", "float16", blocks=True) == torch.float16
    assert runtime.default_cache_dtype("cuda", "bfloat16", blocks=True) == torch.float32
