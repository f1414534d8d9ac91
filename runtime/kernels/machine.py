"""The machine a kernel choice is kept for: its CPU, the key of its choice files, its load, and
writing those files whole.

Must not import Qt. Nothing is probed at import time. A kernel's speed and bits depend on the
CPU's model and flags, the torch build, the thread count and the instruction limits set in the
environment, so :func:`machine_key` hashes those and every choice file is named by it
(``kernels-<machine key>.json`` beside a model's converted weights; inductor's compiled code
in a folder of the same name).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: Bump when kernels or their timing change: older choice files are measured again.
#: 3: bfloat16 weights compute in float32 (new candidates); choices timed on a busy
#: machine are no longer kept (some version-2 files held such choices).
#: 4: decode kernels timed streaming every matrix of a token from memory (version 3
#: timed each shape again and again from the CPU's cache, which hid a 1.5x difference).
#: 5: the bfloat16 prefill kernel (widen-bf16) is a candidate: choices kept without it are
#: measured again. 6: prefill timed at 256 rows (a prompt chunk), not 64.
CHOICE_VERSION = 6

#: The CPU flags that decide between kernels (shown by ``attnchat bench``).
NOTABLE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                 "amx_bf16", "amx_int8", "amx_tile")

#: Environment variables that limit which instructions torch's, oneDNN's, MKL's and FBGEMM's
#: kernels use: they change a kernel's speed and its bits (FBGEMM's float16 product is
#: row-invariant with its AVX-512 kernels, not with its AVX2 ones), so they are part of the key.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
           "FBGEMM_ENABLE_INSTRUCTIONS")


def cpu_info() -> dict:
    """``{"model": CPU model name, "flags": [sorted flags], "capability": torch's ISA level}``
    (``/proc/cpuinfo`` on Linux; the flags list is empty elsewhere)."""
    import platform

    name, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = sorted(line.split(":", 1)[1].split())
                if name and flags:
                    break
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older builds
        capability = "unknown"
    return {"model": name or platform.processor() or platform.machine(), "flags": flags, "capability": capability}


def machine_key() -> str:
    """A short hash (16 hex digits) of what decides the kernels' speed and bits: CPU model and
    flags, torch version, threads, and any of :data:`ISA_ENV` that is set."""
    info = cpu_info()
    from runtime.kernels.threads import max_threads

    isa = {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}
    raw = json.dumps([CHOICE_VERSION, info["model"], info["flags"], torch.__version__, max_threads()]
                     + ([isa] if isa else []))
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def kernel_file(folder: Path | None) -> Path | None:
    """``folder/kernels-<machine key>.json``: where this machine's choices are kept (None: none)."""
    return None if folder is None else folder / f"kernels-{machine_key()}.json"


def machine_load() -> float | None:
    """The 1-minute load average (runnable processes; None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy() -> bool:
    """Whether other programs have the cores (a load of at least the CPU count): timings taken
    now are noise."""
    load = machine_load()
    return load is not None and load >= (os.cpu_count() or 1)


def keep_json(path: Path, data: dict, what: str) -> None:
    """Write ``data`` to ``path`` as JSON whole or not at all (a pid-named temporary file, then a
    rename: processes that measure at once never leave half a file); an OS error is logged."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        log.warning("could not keep %s", what, exc_info=True)
        tmp.unlink(missing_ok=True)
