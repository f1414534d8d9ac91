"""Failures in the words the user sees: one line, and out-of-memory told apart.

Imports nothing of the project (no torch: torch's OutOfMemoryError is recognised by name).
"""
from __future__ import annotations

__all__ = ["first_line", "is_out_of_memory"]


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def is_out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, or torch's (CUDA/MPS) OutOfMemoryError, told apart without importing torch."""
    return isinstance(e, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(e).__mro__)
