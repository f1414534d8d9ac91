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
