"""runtime.fit: weights at the file's size plus the planner's KV cache at a context, against free memory."""
from __future__ import annotations

import pytest

import runtime

# Llama 3.2 1B's shape (16 layers, 8 KV heads of 64) and its Q4_K_M file's size in bytes.
SHAPE = dict(layers=16, kv_heads=8, head_dim=64)
FILE = 807_694_464
KV_8K = 2 * 16 * 8 * 64 * 4 * 8192      # float32 K and V at 8,192 tokens: 536,870,912 bytes


@pytest.mark.parametrize("free, verdict", [
    (2_000_000_000, "fits"),             # 1,344,565,376 bytes take 67 % of it
    (1_600_000_000, "tight"),            # 84 %
    (1_344_565_376, "tight"),            # exactly all of it
    (1_300_000_000, "does not fit"),
])
def test_verdicts(free, verdict):
    f = runtime.fit(FILE, **SHAPE, context=8192, device="cpu", free_bytes=free)
    assert (f.verdict, f.weights_bytes, f.kv_bytes, f.total_bytes, f.free_bytes) == (
        verdict, FILE, KV_8K, FILE + KV_8K, free)
    assert (f.context, f.device, f.cache_dtype) == (8192, "cpu", "float32")


def test_sliding_windows_and_the_cache_dtype_count():
    # Gemma 3 1B: 26 layers of 1 KV head of 256; 22 of them hold at most 512 tokens.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    f = runtime.fit(1000, layers=26, kv_heads=1, head_dim=256, context=8192, windows=windows, cache_dtype="float16",
                    free_bytes=10**9)
    assert f.kv_bytes == 2 * 256 * 2 * (4 * 8192 + 22 * 512) and f.cache_dtype == "float16"


def test_free_memory_from_the_device_when_not_given():
    f = runtime.fit(FILE, **SHAPE, context=1024, device="cpu")
    assert f.free_bytes == pytest.approx(runtime.free_memory_bytes("cpu"), rel=0.2)
    assert f.verdict in ("fits", "tight", "does not fit")
    assert f.to_dict()["total_bytes"] == FILE + KV_8K // 8


@pytest.fixture(scope="module")
def tiny_q4k(tmp_path_factory):
    """A tiny Llama GGUF of Q4_K blocks with a tokenizer, and its cache folder."""
    from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

    folder = tmp_path_factory.mktemp("fit-q4k")
    return make_tiny_gguf(folder, tokenizer=tiny_tokenizer_metadata(), matrix_type="Q4_K"), folder / "cache"


@pytest.mark.parametrize("reproducible", [False, True])
def test_the_fits_cache_is_what_a_loaded_model_allocates(tiny_q4k, reproducible, monkeypatch):
    """The fit planned a float32 cache for a quantized GGUF while the runtime, running it from
    its blocks on the CPU, holds float16: twice the cache. Reproducible replies widen it to
    float weights computing in float32, and the cache is float32 again."""
    path, cache_dir = tiny_q4k
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(cache_dir))
    m = runtime.load_model(path, device="cpu", threads=1, reproducible=reproducible)
    c = m.config
    tokens = 24
    f = runtime.fit(path.stat().st_size, layers=c.n_layers, kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                    context=tokens, windows=c.windows, device="cpu", free_bytes=10**9,
                    block_type="Q4_K", architecture="llama", reproducible=reproducible)
    cache = m.new_cache(tokens)
    m.logits(list(range(4, 4 + tokens)), cache)
    assert cache.length == tokens
    assert str(cache.k[0].dtype).removeprefix("torch.") == f.cache_dtype == ("float32" if reproducible else "float16")
    assert cache.used_bytes == f.kv_bytes
    assert cache.k[0].element_size() * 2 * c.n_layers * c.n_kv_heads * c.head_dim * tokens == f.kv_bytes


@pytest.mark.parametrize("block_type, architecture, dtype", [
    ("Q4_K", "llama", "float16"),    # runs from its blocks: the runtime's float16 cache on the CPU
    ("Q8_0", "qwen2", "float16"),
    ("F16", "llama", "float32"),     # a float file loads as float16 weights computing in float32
    ("Q4_K", "mamba", "float32"),    # a family not run from its blocks
    ("", "", "float32"),             # unknown
])
def test_the_cache_dtype_is_the_runtimes_default_for_the_file(block_type, architecture, dtype):
    f = runtime.fit(FILE, **SHAPE, context=8192, device="cpu", free_bytes=2_000_000_000,
                    block_type=block_type, architecture=architecture)
    assert (f.cache_dtype, f.kv_bytes) == (dtype, KV_8K // (2 if dtype == "float16" else 1))
    cuda = runtime.fit(FILE, **SHAPE, context=8192, device="cuda", free_bytes=2_000_000_000,
                       block_type=block_type, architecture=architecture)
    assert cuda.cache_dtype == "float16"   # float16 weights compute in float16 there, blocks or not
