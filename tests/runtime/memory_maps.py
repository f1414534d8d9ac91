"""Where a loaded model's matrices live: the files mapped at their addresses (Linux)."""
from __future__ import annotations

import sys

import pytest


def mapped_files(model) -> set[str]:
    """The files whose memory mappings hold each of the decoder's matrices
    (``/proc/self/maps``); '' for a matrix in anonymous memory (a copy). Skips the
    calling test off Linux."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in parts[0].split("-"))
            maps.append((lo, hi, parts[5].strip() if len(parts) > 5 else ""))
    found = set()
    for p in model.decoder.parameters():
        if p.dim() == 2:
            ptr = p.data_ptr()
            found.add(next((f for lo, hi, f in maps if lo <= ptr < hi), ""))
    return found
