"""The KV cache's dtype for a GGUF's blocks on the CPU, timed per machine and head size
(runtime/kernels/cache_dtype.py): the rule that picks among the timings, the timing itself on
ggml's flash attention, the choice kept and read back, and a load and a fit that both follow it."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.kernels import cache_dtype as cd
from runtime.kernels import ggml_ops
from runtime.kernels.machine import kernel_file

needs_ggml = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python is not installed")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    cd._chosen.cache_clear()
    yield
    cd._chosen.cache_clear()


@pytest.mark.parametrize("times, chosen", [
    ({"float16": 450.0, "bfloat16": 84.0, "float32": 67.0}, torch.bfloat16),   # Xeon, 64-wide heads
    ({"float16": 68.0, "bfloat16": 115.0, "float32": 92.0}, torch.float16),    # Xeon, 128-wide heads
    ({"float16": 100.0, "bfloat16": 100.0, "float32": 70.0}, torch.float16),   # a tie: more mantissa; float32 < 1.5x
    ({"float16": 100.0, "bfloat16": 120.0, "float32": 60.0}, torch.float32),   # float32 1.67x the best 2-byte one
    ({"float16": 300.0, "bfloat16": 210.0, "float32": 150.0}, torch.bfloat16),  # 1.4x: not worth twice the bytes
])
def test_the_rule_prefers_fewer_bytes_unless_a_wider_dtype_is_much_faster(times, chosen):
    assert cd.choose(times) == chosen


@needs_ggml
def test_every_candidate_is_timed_on_ggmls_flash_attention():
    times = cd.measure(64, reps=2)
    assert set(times) == {"float16", "bfloat16", "float32"} and all(0 < t < 1e5 for t in times.values())


@needs_ggml
def test_the_choice_is_measured_once_kept_and_read_back(tmp_path, monkeypatch):
    from runtime.kernels import machine

    monkeypatch.setattr(machine, "busy", lambda: False)   # a busy machine runs float16 unmeasured, keeps nothing
    folder = tmp_path / "kept"
    folder.mkdir()
    first = cd.blocks_cache_dtype(64, folder)
    kept = json.loads(kernel_file(folder).read_text())["cache-dtype"]["64"]
    assert kept["dtype"] == str(first).removeprefix("torch.") and set(kept["timings_us"]) == {"float16", "bfloat16", "float32"}
    assert cd.choose(kept["timings_us"]) == first
    assert kept["candidates"] == ["float16", "bfloat16", "float32"]
    # a choice in the file is what later loads take, without timing again
    kernel_file(folder).write_text(json.dumps({"cache-dtype": {"64": {"dtype": "float32", "candidates": kept["candidates"]}}}))
    cd._chosen.cache_clear()
    assert cd.blocks_cache_dtype(64, folder) == torch.float32
    # an entry naming no candidate, or chosen among other candidates, is measured again
    for stale in ({"dtype": "int8", "candidates": kept["candidates"]}, {"dtype": "float32", "candidates": ["float16", "float32"]}):
        kernel_file(folder).write_text(json.dumps({"cache-dtype": {"64": stale}}))
        cd._chosen.cache_clear()
        assert cd.blocks_cache_dtype(64, folder) == cd.choose(
            json.loads(kernel_file(folder).read_text())["cache-dtype"]["64"]["timings_us"])


def test_unmeasured_it_is_float16(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    assert cd.blocks_cache_dtype(64, tmp_path) == torch.float16 and not any(tmp_path.iterdir())
    assert cd.blocks_cache_dtype(None, tmp_path) == torch.float16


@needs_ggml
def test_a_load_and_a_fit_give_the_file_the_kept_dtype(tmp_path, monkeypatch):
    """What the memory figures quote is the cache the load makes: both read the machine's kept
    choice for the file's head size (here set by hand to float32, then bfloat16)."""
    import runtime
    from runtime.memory.sizes import cache_bytes_per_token
    from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

    path = make_tiny_gguf(tmp_path, tokenizer=tiny_tokenizer_metadata(), matrix_type="Q4_K", embed_type="Q8_0")
    cfg = runtime.read_config(str(path))
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    for dtype in ("float32", "bfloat16"):
        entry = {"dtype": dtype, "candidates": ["float16", "bfloat16", "float32"]}
        kernel_file(cache).write_text(json.dumps({"cache-dtype": {str(cfg.head_dim): entry}}))
        cd._chosen.cache_clear()
        m = runtime.load_model(str(path), device="cpu", threads=1)
        assert str(m.cache_dtype) == f"torch.{dtype}" and m.new_cache(8).dtype == getattr(torch, dtype)
        f = runtime.fit(path.stat().st_size, layers=cfg.n_layers, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                        context=64, block_type="Q4_K", architecture="llama")
        assert f.cache_dtype == dtype
        assert f.kv_bytes == 64 * cache_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype)
