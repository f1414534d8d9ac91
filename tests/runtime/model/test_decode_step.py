"""The static decode step (runtime.model.decode_step) equals the eager reference path.

The GPU runs the static step as a CUDA graph; the graph replays exactly the kernels of
the static step, so checking the static step here (every family, dtype, GQA strategy
and capacity-bucket change) checks what the graph computes. ``torch.compile`` of the
same step runs here too.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import load_model
from runtime.model.attention import AttentionKernels
from runtime.model.decode_step import DecodeStep

from tests.runtime.tiny_models import FAMILIES, MORE_FAMILIES, make_tiny_model

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-decode")
    return {f: make_tiny_model(root, f, max_positions=640) for f in FAMILIES + MORE_FAMILIES}


def _decode(model, mode: str, n: int, *, chunk: int = 16, start: list[int] = PROMPT):
    """Greedy ``n`` tokens after ``start``: (token ids, logits per step (n, V))."""
    cache = model.new_cache(model.config.max_position_embeddings)
    cache.chunk_tokens = chunk  # small buckets: the static step crosses several
    step = DecodeStep(model.decoder, mode)
    logits = model.logits(start, cache, last_only=True)[0, -1]
    ids, rows = [], []
    for _ in range(n):
        tok = int(logits.argmax())
        ids.append(tok)
        logits = step(tok, cache)[0, -1].clone()
        rows.append(logits)
    assert cache.length == len(start) + n
    return ids, torch.stack(rows), cache


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_static_step_equals_eager_float32(tiny_dir, family):
    """Every family (sliding-window ones fall back to eager: their buffer moves)."""
    model = load_model(tiny_dir[family], device="cpu", dtype="float32")
    ids_e, rows_e, cache_e = _decode(model, "eager", 40)
    ids_s, rows_s, cache_s = _decode(model, "static", 40)
    assert ids_s == ids_e
    torch.testing.assert_close(rows_s, rows_e, atol=1e-5, rtol=1e-5)
    # Both wrote the same keys and values (float32 rounding apart: since RoPE's angles are
    # float32 as in transformers, the gathered rows and the eager step's own rows differ in
    # the last bits; Qwen3's per-head key norm then gave 1.6e-6 at one position, measured).
    n = cache_e.length
    for ke, ks in zip(cache_e.k, cache_s.k):
        torch.testing.assert_close(ks[:, :, :n], ke[:, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,compute,tol", [("float16", None, 2e-2), ("float16", "float16", 2e-2),
                                               ("bfloat16", None, 2e-2), ("bfloat16", "bfloat16", 1e-1)])
@pytest.mark.parametrize("gqa", ["sdpa", "fold"])
def test_static_step_equals_eager_in_16_bit(tiny_dir, dtype, compute, tol, gqa):
    """16-bit weights computing in float32 (the CPU's way) or in their own dtype (float16
    is the GPU default), both GQA strategies (the fold is the CUDA default)."""
    model = load_model(tiny_dir["llama"], device="cpu", dtype=dtype, compute=compute,
                       kernels=AttentionKernels(decode_gqa=gqa))
    _, rows_e, _ = _decode(model, "eager", 24)
    _, rows_s, _ = _decode(model, "static", 24)
    torch.testing.assert_close(rows_s, rows_e, atol=tol, rtol=tol)


def test_cuda_kernel_choices_on_the_cpu(tiny_dir):
    """The CUDA defaults (fold, restricted SDPA backends) computed on the CPU equal the CPU defaults."""
    from runtime.model.attention import attention_kernels

    cuda_kernels = attention_kernels("cuda")
    assert cuda_kernels.decode_gqa == "fold" and "CUDNN_ATTENTION" not in cuda_kernels.sdpa_backends
    cpu_like = load_model(tiny_dir["qwen2"], device="cpu", dtype="float32")
    cuda_like = load_model(tiny_dir["qwen2"], device="cpu", dtype="float32",
                           kernels=AttentionKernels("fold", ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")))
    ids = PROMPT * 4
    torch.testing.assert_close(cuda_like.logits(ids), cpu_like.logits(ids), atol=1e-5, rtol=1e-5)
    _, rows_a, _ = _decode(cpu_like, "eager", 16)
    _, rows_b, _ = _decode(cuda_like, "static", 16)
    torch.testing.assert_close(rows_b, rows_a, atol=1e-5, rtol=1e-5)


def test_modes_can_alternate_on_one_cache(tiny_dir):
    """A session may switch between eager and static between tokens (the Live tab does)."""
    model = load_model(tiny_dir["llama"], device="cpu", dtype="float32")
    ids_e, rows_e, _ = _decode(model, "eager", 20)
    cache = model.new_cache(640)
    eager, static = DecodeStep(model.decoder, "eager"), DecodeStep(model.decoder, "static")
    logits = model.logits(PROMPT, cache, last_only=True)[0, -1]
    rows = []
    for i in range(20):
        logits = (static if i % 2 else eager)(int(logits.argmax()), cache)[0, -1].clone()
        rows.append(logits)
    torch.testing.assert_close(torch.stack(rows), rows_e, atol=1e-5, rtol=1e-5)


def test_static_step_after_crop_and_at_the_context_end(tiny_dir):
    from runtime.errors import CacheLimitError

    model = load_model(tiny_dir["llama"], device="cpu", dtype="float32")
    cache = model.new_cache(40)
    step = DecodeStep(model.decoder, "static")
    model.logits(PROMPT * 4, cache)  # 32 tokens
    cache.crop(10)  # stale keys stay in slots 10..31: the mask must hide them
    got = step(PROMPT[3], cache)[0, -1]
    ref = model.logits((PROMPT * 4)[:10] + [PROMPT[3]])[0, -1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    while cache.length < 40:
        step(1, cache)
    with pytest.raises(CacheLimitError):
        step(1, cache)


def test_token_may_stay_on_the_device(tiny_dir):
    model = load_model(tiny_dir["gpt2"], device="cpu", dtype="float32")
    cache_a, cache_b = model.new_cache(64), model.new_cache(64)
    step = DecodeStep(model.decoder, "static")
    model.logits(PROMPT, cache_a)
    model.logits(PROMPT, cache_b)
    a = step(torch.tensor(42), cache_a)
    b = step(42, cache_b)
    assert torch.equal(a, b)


def test_unknown_mode_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="unknown decode mode"):
        load_model(tiny_dir["llama"], device="cpu", decode="turbo")
    with pytest.raises(ValueError, match="needs CUDA"):
        load_model(tiny_dir["llama"], device="cpu", decode="graph")


@pytest.mark.slow
def test_a_chat_session_gives_the_same_replies_in_every_cpu_mode(tiny_dir):
    """Two turns (prefix reuse, crop, chunked prefill) with sampling: the static step changes nothing."""
    from runtime import ChatSession, GenerationSettings, SamplingParams

    replies = {}
    for mode in ("eager", "static"):
        model = load_model(tiny_dir["qwen2"], device="cpu", dtype="float32", decode=mode)
        settings = GenerationSettings(sampling=SamplingParams(temperature=0.8, top_k=40, seed=3), max_new_tokens=24,
                                      prefill_chunk=7)
        session = ChatSession(model, settings=settings)
        replies[mode] = [session.run(session.send(text)).text for text in ("the cat and the dog", "which one is it")]
        assert session.last_stats.reused_tokens > 0
    assert replies["static"] == replies["eager"]


def test_python_hooks_take_the_eager_path(tiny_dir):
    """An attention observer (the Live tab) or a head knock-out runs Python per layer: a
    graph would bake in what it saw at capture time, so the step falls back to eager."""
    model = load_model(tiny_dir["llama"], device="cpu", dtype="float32")
    step, cache = DecodeStep(model.decoder, "static"), model.new_cache(64)
    assert step.static_ok(cache)
    model.decoder.blocks[1].attn.head_edit = lambda layer, y: y * 0
    assert not step.static_ok(cache)
    model.logits(PROMPT, cache)
    knocked = step(7, cache)[0, -1]
    cache.crop(len(PROMPT))
    eager = DecodeStep(model.decoder, "eager")(7, cache)[0, -1]
    assert torch.equal(knocked, eager)
    model.decoder.blocks[1].attn.head_edit = None
    model.decoder.observer = lambda layer, weights: None
    assert not step.static_ok(cache)
    model.decoder.observer = None
    assert step.static_ok(cache) and not DecodeStep(model.decoder, "eager").static_ok(cache)


@pytest.mark.slow
def test_the_compiled_step_compiles_once_for_every_capacity_and_in_the_background(tiny_dir, tmp_path, monkeypatch):
    """torch.compile (inductor's C++ backend here) of the static step: the same tokens and
    logits as eager; one graph (the cache's token axis symbolic) across capacity buckets;
    prepared in a background thread while tokens decode eagerly; kept in the app's inductor
    folder."""
    from torch._dynamo.utils import counters

    from runtime.model.decode_step import INDUCTOR_CACHE_ENV, use_inductor_cache

    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path))
    folder = use_inductor_cache()
    assert folder.startswith(str(tmp_path / "inductor")) and len(folder.rsplit("/", 1)[1]) == 16
    model = load_model(tiny_dir["llama"], device="cpu", dtype="float32", decode="compile")
    assert model.decode_state == "compile: none"
    model.logits(PROMPT[:4], model.new_cache(64))  # the eager path fills the RoPE tables first (as in a chat)
    torch._dynamo.reset()
    counters.clear()
    done = model.prepare_decode(background=True)
    assert model.decode_state in ("compile: compiling", "compile: ready")
    ids_e, rows_e, _ = _decode(model, "eager", 40)  # meanwhile: eager, same results
    cache = model.new_cache(model.config.max_position_embeddings)
    cache.chunk_tokens = 16
    logits = model.logits(PROMPT, cache, last_only=True)[0, -1]
    ids, rows = [], []
    for i in range(40):  # crosses three capacity buckets
        if i == 5:
            assert done.wait(600) and model.decode_state == "compile: ready"
        ids.append(int(logits.argmax()))
        logits = model.decode_next(ids[-1], cache)[0, -1].clone()
        rows.append(logits)
    assert ids == ids_e
    torch.testing.assert_close(torch.stack(rows), rows_e, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert any(Path(folder).rglob("*.py"))  # inductor wrote the compiled step there


def test_a_step_that_cannot_compile_decodes_eagerly(tiny_dir, monkeypatch):
    """No C++ compiler (or any inductor error): one log line, then the eager path, same tokens."""
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("InductorError: no C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    model = load_model(tiny_dir["llama"], device="cpu", dtype="float32")
    ids_e, rows_e, _ = _decode(model, "eager", 20)
    step = DecodeStep(model.decoder, "compile")
    assert step.prepare(model.new_cache(64), background=False).is_set()
    assert step.compile_state == "failed"
    ids_c, rows_c, _ = _decode(model, "compile", 20)  # a fresh step: fails on its first token
    assert ids_c == ids_e
    torch.testing.assert_close(rows_c, rows_e, atol=1e-6, rtol=1e-6)
