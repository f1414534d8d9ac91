"""The device profile: what a device runs with where the caller does not say, decided once per
device in a process, with the reproducible mode as a variant of it."""
from __future__ import annotations

import pytest
import torch

import runtime.device as device_mod
from runtime.device import DeviceProfile, compute_dtype, device_profile, profile_of
from runtime.dtypes import WEIGHT_DTYPES


def test_the_cpu_profile_holds_the_cpu_defaults():
    p = device_profile("cpu")
    assert (p.device, p.weight_dtype, p.decode_mode, p.linear_path, p.reproducible) == \
        (torch.device("cpu"), torch.float16, "eager", "cpu", False)
    assert p.compute_dtypes == {w: compute_dtype("cpu", w) for w in WEIGHT_DTYPES.values()}
    assert p.compute_dtypes[torch.float16] == torch.float32 and p.compute_dtypes[torch.float32] == torch.float32


def test_a_gpu_profile_holds_its_own_defaults():
    # Without CUDA here (the planner's figures for a GPU elsewhere): the device type's choices.
    p = profile_of("cuda")
    assert (p.weight_dtype, p.decode_mode, p.linear_path) == (torch.float16, "graph", "accelerator")
    assert p.compute_dtypes[torch.float16] == torch.float16 and p.compute_dtypes[torch.bfloat16] == torch.float32
    with pytest.raises(ValueError, match="reproducible replies run on the CPU with eager decode"):
        p.reproducible_variant()
    assert p.with_decode("eager").decode_mode == "eager" and p.decode_mode == "graph"


def test_the_defaults_are_decided_once_per_device(monkeypatch):
    calls = []
    real = device_mod.default_dtype
    monkeypatch.setattr(device_mod, "default_dtype", lambda dev: calls.append(dev) or real(dev))
    device_mod._profile.cache_clear()
    try:
        first = device_profile("cpu")
        assert device_profile("cpu") is first
        assert device_profile(torch.device("cpu"), decode="static").decode_mode == "static"
        assert device_profile("cpu", reproducible=True).reproducible
        assert profile_of("cpu") is first
        assert calls == [torch.device("cpu")]
    finally:
        device_mod._profile.cache_clear()   # the next test's profiles use the real default_dtype


def test_the_reproducible_variant_is_the_same_profile_but_reproducible():
    p = device_profile("cpu")
    r = device_profile("cpu", reproducible=True)
    assert isinstance(r, DeviceProfile) and r.reproducible and not p.reproducible
    assert (r.device, r.weight_dtype, r.decode_mode, r.linear_path) == (p.device, p.weight_dtype, p.decode_mode,
                                                                        p.linear_path)
    with pytest.raises(ValueError, match=r"decode static\)$"):
        device_profile("cpu", decode="static", reproducible=True)


def test_graph_decode_needs_cuda():
    with pytest.raises(ValueError, match="decode mode 'graph' needs CUDA"):
        device_profile("cpu", decode="graph")


def test_a_cuda_profile_takes_the_graph_mode_on_any_machine():
    """The check is the profile's device, not this machine's: a CUDA profile (the planner's,
    for a GPU elsewhere) decodes eagerly or as a graph when asked, and says so."""
    cuda = profile_of("cuda")
    assert cuda.decode_mode == "graph" and cuda.with_decode(None) is cuda
    eager = cuda.with_decode("eager")
    assert eager.decode_mode == "eager" and eager.device == torch.device("cuda")
    assert eager.with_decode("graph") == cuda


def test_the_device_type_is_read_of_every_kind_of_place():
    """``device_type``/``on_cpu``, the one reading of a device's type the runtime's device
    branches go through: a device, its name, a tensor, or anything holding a ``.device``."""
    from types import SimpleNamespace

    from runtime.device import device_type, on_cpu

    meta = torch.empty(2, device="meta")
    assert [device_type(x) for x in ("cpu", "cuda:1", torch.device("mps"), meta, torch.zeros(1))] == \
        ["cpu", "cuda", "mps", "meta", "cpu"]
    assert device_type(SimpleNamespace(device=torch.device("cuda", 0))) == "cuda"
    assert on_cpu("cpu") and on_cpu(torch.zeros(1)) and not on_cpu(meta) and not on_cpu("cuda")


def test_an_embedding_off_the_cpu_decodes_with_torch_ops(tmp_path):
    """The blocks of an embedding moved off the CPU (the meta device stands for a GPU) decode
    with torch ops there, as a CUDA graph can capture, and a projection there has no copy-free
    prefill kernel (ggml widens on the CPU only)."""
    from runtime.model.quant_layers import QuantEmbedding, _copy_free_default
    from runtime.weights.gguf.mmap import read_gguf_tensors
    from runtime.weights.gguf.names import gguf_weights
    from tests.runtime.tiny_gguf import make_tiny_gguf

    g = read_gguf_tensors(make_tiny_gguf(tmp_path, matrix_type="Q4_K", embed_type="Q8_0"))
    md = g.metadata
    w = gguf_weights(g, md["llama.block_count"], md["llama.attention.head_count"], md["llama.attention.head_count_kv"])
    embed = QuantEmbedding(w.embed)
    embed.to_device("cpu")
    assert not embed.torch_decode
    embed.to_device("meta")
    assert embed.torch_decode and embed.weight_q.raw.device.type == "meta"
    part = w.matrices["blocks.0.attn.o_proj"][0]
    assert _copy_free_default(part, torch.device("cpu")) is not None    # ggml's widening here
    assert _copy_free_default(part, torch.device("meta")) is None
