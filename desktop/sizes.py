"""Byte counts in words, one unit family for the whole window and the command line.

The KV-cache panel, the settings' memory planner and the command line speak MiB and GiB
(powers of 2); downloads, the model cards and the fit lines said MB (powers of 10), so one
window showed the same file as 1,060 MB and as 1,010.9 MiB. Every size in the window goes
through :func:`size_text` (``models.sizes.size_text``, which the command line uses too).

Imports models only.
"""
from __future__ import annotations

from models.sizes import size_text as _size_text

__all__ = ["KIB", "MIB", "GIB", "free_where", "part_text", "rate_text", "size_text"]

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def size_text(n: int | float | None) -> str:
    """``n`` bytes in words: ``"512 B"``, ``"6.5 KiB"``, ``"93.8 MiB"``, ``"1,010.9 MiB"``,
    ``"4.1 GiB"`` (from 1 GiB on, as ``attnchat models list`` says it); ``"—"`` for None."""
    return "—" if n is None else _size_text(n)


def part_text(done: int, total: int) -> str:
    """``done`` of ``total`` bytes in ``total``'s unit: ``"41.8 of 93.8 MiB"``, ``"0.2 of 1.0 GiB"``
    (only ``done`` when the total is not known: 0)."""
    if total <= 0:
        return size_text(done)
    unit, div = next((u, d) for u, d in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB), ("B", 1)) if total >= d or d == 1)
    digits = 0 if div == 1 else 1
    return f"{done / div:,.{digits}f} of {total / div:,.{digits}f} {unit}"


def rate_text(bytes_per_s: float) -> str:
    """A download's speed: ``"3.1 MiB/s"`` (``"850.0 KiB/s"`` below 1 MiB/s)."""
    return f"{bytes_per_s / MIB:,.1f} MiB/s" if bytes_per_s >= MIB else f"{bytes_per_s / KIB:,.1f} KiB/s"


def free_where(device: str) -> str:
    """How free memory is named after its figure: ``"of free memory"`` for the CPU (the
    computer's memory; "free on the CPU" read oddly), ``"free on cuda:0"`` for a GPU."""
    return "of free memory" if str(device) in ("cpu", "the CPU") else f"free on {device}"
