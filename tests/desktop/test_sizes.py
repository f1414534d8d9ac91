"""Sizes in the window: one unit family (MiB, GiB) as the KV panel, the planner and the command line
use; the window had said 1,060 MB for the file the CLI lists as 1010.9 MiB."""
from __future__ import annotations

import models
from desktop.sizes import free_where, part_text, rate_text, size_text


def test_sizes_read_in_binary_units_as_the_command_line_says_them():
    big = next(e for e in models.CATALOG if e.name == "SmolLM2-1.7B-Instruct")
    assert size_text(big.size_bytes) == "1,010.9 MiB"   # `attnchat models list`: 1010.9 MiB
    assert size_text(models.DEFAULT_MODEL.size_bytes) == "93.8 MiB"
    assert [size_text(n) for n in (0, 1023, 1024, 6_700, 2**20, 4_400_000_000)] == [
        "0 B", "1,023 B", "1.0 KiB", "6.5 KiB", "1.0 MiB", "4.1 GiB"]
    assert size_text(None) == "—"
    assert part_text(41_800_000, 98_400_000) == "39.9 of 93.8 MiB" and part_text(5, 800) == "5 of 800 B"
    assert part_text(2**29, 2**30) == "0.5 of 1.0 GiB" and part_text(3 * 2**20, 0) == "3.0 MiB"
    assert rate_text(3 * 2**20) == "3.0 MiB/s" and rate_text(512_000) == "500.0 KiB/s"
    assert free_where("cpu") == "of free memory" and free_where("cuda:0") == "free on cuda:0"


def test_the_fit_line_says_free_memory_in_the_windows_units():
    from desktop.model_switcher.dialog import fit_line

    fit = {"verdict": "fits", "total_bytes": 1_344_600_000, "context": 8192, "device": "cpu",
           "free_bytes": 21_644_300_000}
    assert fit_line(fit) == ("<p><b>Fits this machine:</b> fits (1.3 GiB: the file and the KV cache at 8,192 tokens; "
                             "20.2 GiB of free memory)</p>")
    assert "93.1 GiB free on cuda:0)" in fit_line(dict(fit, device="cuda:0", free_bytes=100_000_000_000))
