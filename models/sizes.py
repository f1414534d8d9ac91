"""Byte counts as the command line and the window show them: one convention for both.

Binary units throughout (KiB = 1,024 bytes, MiB = 2**20, GiB = 2**30), the units of the
options that take sizes (``--cache-limit-mib``, ``--pool-mib``, ``--cache-budget 24MiB``)
and of the KV-cache and memory figures; a file's size in the same units, so a download
and the memory it will take read alike. Stdlib only.
"""
from __future__ import annotations

__all__ = ["size_text"]

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def size_text(n: int | float) -> str:
    """``n`` bytes for a person: ``"512 B"``, ``"12.0 KiB"``, ``"93.8 MiB"``, ``"1,010.9 MiB"``,
    ``"4.4 GiB"`` (one decimal from KiB on, thousands separated, the unit from 1 of it).

    Raises:
        ValueError: ``n`` negative.
    """
    if n < 0:
        raise ValueError(f"a size cannot be negative; got {n}")
    if n < KIB:
        return f"{int(n):,} B"
    unit, name = next((u, s) for u, s in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")) if n >= u)
    return f"{n / unit:,.1f} {name}"
