"""Device and dtype choice. Must not import Qt; probes nothing at import time."""
from __future__ import annotations

import torch

from runtime.errors import DeviceError


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> CUDA if available, then Apple MPS, then CPU; others are checked.

    Raises:
        DeviceError: the named device is not available here (one line, with what is).
    """
    name = str(device).lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"there is no {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device {device!r} was asked for but Apple MPS is not available here; use cpu or auto")
    elif dev.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """The weights' default dtype on a device.

    - CPU: float32. Most desktop CPUs have no fast bfloat16/float16 matrix units
      (no AMX), so 16-bit weights decode no faster there, and float32 keeps parity
      with the reference exact (see the benchmark issue's table: transformers'
      bf16 decodes slower than fp32 on our 2-core machines).
    - CUDA: bfloat16 where supported (Ampere and newer), else float16: half the
      bytes per token read, and tensor cores.
    - MPS: float16 (bfloat16 support on MPS depends on the macOS version).
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def available_devices() -> list[tuple[str, str]]:
    """The devices this machine can run on, as ``(name, description)`` pairs.

    ``("auto", ...)`` and ``("cpu", "CPU")`` always; one ``("cuda:N", "CUDA N: <GPU name>")``
    per CUDA device; ``("mps", "Apple MPS")`` where available. Probes when called (the
    CUDA names initialise CUDA), never at import time.
    """
    out = [("auto", "Automatic (CUDA, then Apple MPS, then CPU)"), ("cpu", "CPU")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                name = torch.cuda.get_device_name(i)
            except Exception:  # noqa: BLE001 - a device we cannot query is still listed
                name = "GPU"
            out.append((f"cuda:{i}", f"CUDA {i}: {name}"))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append(("mps", "Apple MPS"))
    return out
