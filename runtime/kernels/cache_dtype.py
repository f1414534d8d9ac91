"""The KV cache's dtype for a GGUF run from its blocks on the CPU, chosen by timing ggml's
flash attention on this machine at the model's head size.

Must not import Qt. Nothing is timed at import time.

Why measure: such a model decodes a token as one ggml graph whose flash attention reads the
cache's keys and values in place, and how fast ggml reads a float16 cache depends on the CPU
and the head size. Its float16 dot product runs a vector loop over whole steps of the CPU's
float16 registers and a scalar loop over the rest: on an Intel Xeon with AVX512-FP16
(family 6 model 167, 2 vCPUs) a step is 128 values, so a 64-wide head (SmolLM2, Llama 3.2 1B,
Qwen2.5) runs entirely in the scalar loop. One token's attention over 1,024 keys there, 30
layers of 9 query and 3 key-value heads: float16 15.4 ms, bfloat16 3.2 ms, float32 2.6 ms;
with 128-wide heads (32 and 8 heads) float16 was the fastest (10.2, 16.5, 15.3 ms). The
default model's whole token at 1,024 keys took 24-25 ms with a float16 cache, 11.6-13.4 ms
with float32 and 12.9 ms with bfloat16. On an AMD EPYC Zen 4 float16 was the faster (11.2 against 12.6 ms a token at a
depth of 128), and it halves the cache's memory: float16 stays the default and the choice
without a measurement.

The candidates are the cache dtypes the graph takes whose greedy agreement with the float32
dequantized run was measured (scripts/prefill_quality.py, the default model, 8 prompts x 128
tokens teacher-forced; Intel Xeon above: float16 97.66 %, bfloat16 97.85 %, float32 96.97 %;
AMD EPYC Zen 4: float16 97.85 %, float32 97.66 %). Between dtypes of the same size the faster
wins (float16 on a tie: more mantissa); a wider one only when it is :data:`MARGIN` times
faster than the best narrower one, since it costs twice the memory per token. Kept per
machine in the cache folder (one choice per head size; the rules of
:func:`runtime.kernels.chooser.load_or_measure`: ``ATTNCHAT_KERNELS=default`` runs float16
unmeasured, and so does a busy machine).
"""
from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.kernels import ggml_ops
from runtime.kernels.chooser import best_time_us, load_or_measure, machine_folder

log = logging.getLogger(__name__)

__all__ = ["CANDIDATES", "DEFAULT", "MARGIN", "blocks_cache_dtype", "measure"]

#: The cache dtypes timed, the preferred first (fewer bytes a token, then more mantissa).
CANDIDATES = (torch.float16, torch.bfloat16, torch.float32)
#: The dtype without a measurement.
DEFAULT = torch.float16
#: How much faster a wider candidate must be to be chosen over the best narrower one.
MARGIN = 1.5
#: The timed attention: keys attended, query and key-value heads, graph nodes a compute.
KEYS, HEADS, KV_HEADS, NODES = 1024, 8, 2, 4
_GGML_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_PREC_F32 = 10


def measure(head_dim: int, reps: int = 5) -> dict[str, float]:
    """Microseconds for one query row's flash attention over :data:`KEYS` keys, per
    candidate (dtype name -> us; the fastest of ``reps`` computes of :data:`NODES` such heads
    groups, divided by :data:`NODES`), on ``torch.get_num_threads()`` threads.

    Raises:
        RuntimeError: ggml's kernels are unavailable.
    """
    from runtime.kernels.ggml_graph import Graph

    D = head_dim
    times = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in CANDIDATES:
        graph = Graph(result_bytes=NODES * HEADS * D * 4 * 2 + (1 << 16), max_nodes=8 * NODES)
        g, ctx = graph.g, graph.ctx
        for _ in range(NODES):
            k, v = (torch.randn(KV_HEADS, KEYS, D, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(HEADS, 1, D, generator=gen)
            o = g.ggml_flash_attn_ext(ctx, graph.leaf(q, (D, 1, HEADS)), graph.leaf(k, (D, KEYS, KV_HEADS), _GGML_TYPES[dtype]),
                                      graph.leaf(v, (D, KEYS, KV_HEADS), _GGML_TYPES[dtype]), None,
                                      1.0 / math.sqrt(D), 0.0, 0.0)
            g.ggml_flash_attn_ext_set_prec(o, _PREC_F32)
            graph.output(o)
        times[str(dtype).removeprefix("torch.")] = best_time_us(graph.compute, reps, warm_up=True) / NODES
    return times


def choose(times_us: dict[str, float]) -> torch.dtype:
    """The candidate ``times_us`` (dtype name -> us) picks: the faster of two of the same size
    (the earlier in :data:`CANDIDATES` on a tie), a wider one only when :data:`MARGIN` times
    faster than the best narrower one."""
    best = CANDIDATES[0]
    for dtype in CANDIDATES[1:]:
        t, t_best = times_us[_name(dtype)], times_us[_name(best)]
        wider = dtype.itemsize > best.itemsize
        if (t * MARGIN < t_best) if wider else (t < t_best):
            best = dtype
    return best


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _CacheChooser:
    """:class:`runtime.kernels.chooser.KernelChooser` for one head size: kept under
    ``"cache-dtype"`` by head size in the machine's file."""

    head_dim: int
    what = "the KV cache's dtype for a GGUF's blocks"
    busy_runs_defaults = True
    timings: dict = field(default_factory=dict)

    @property
    def measurable(self) -> bool:
        return ggml_ops.available()

    def default(self) -> torch.dtype:
        return DEFAULT

    def measure(self) -> torch.dtype:
        self.timings = measure(self.head_dim)
        dtype = choose(self.timings)
        log.info("KV cache for %d-wide heads: %s (flash attention over %d keys, us: %s)", self.head_dim,
                 _name(dtype), KEYS, {k: round(v, 1) for k, v in self.timings.items()})
        return dtype

    def from_kept(self, kept: dict) -> torch.dtype | None:
        """The kept dtype, if it was chosen among today's candidates (else measured again)."""
        entry = kept.get("cache-dtype", {}).get(str(self.head_dim))
        if entry is None or entry.get("candidates") != [_name(c) for c in CANDIDATES]:
            return None
        dtype = getattr(torch, entry["dtype"])
        return dtype if dtype in CANDIDATES else None

    def keep(self, kept: dict, choice: torch.dtype) -> dict:
        kept.setdefault("cache-dtype", {})[str(self.head_dim)] = {
            "dtype": _name(choice), "candidates": [_name(c) for c in CANDIDATES], "timings_us": self.timings}
        return kept


def blocks_cache_dtype(head_dim: int | None, folder: Path | None = None) -> torch.dtype:
    """The KV cache's dtype for a GGUF run from its blocks on the CPU with heads ``head_dim``
    wide: kept for this machine in ``folder`` (default: the cache folder), else timed now
    (:func:`measure`, a few milliseconds) and kept; :data:`DEFAULT` when ``head_dim`` is None,
    ggml does not load, or :func:`runtime.kernels.chooser.load_or_measure` runs the defaults.
    Asked once per head size and folder in a process."""
    if head_dim is None:
        return DEFAULT
    if folder is None:
        folder = machine_folder()
    return _chosen(int(head_dim), folder, os.environ.get("ATTNCHAT_KERNELS", ""))


@functools.lru_cache(maxsize=None)
def _chosen(head_dim: int, folder: Path | None, mode: str) -> torch.dtype:
    """(``mode``: ``ATTNCHAT_KERNELS``, part of the key so that a change of it is obeyed.)"""
    try:
        return load_or_measure(folder, _CacheChooser(head_dim))
    except (RuntimeError, OSError) as e:   # ggml failing mid-measurement: the unmeasured default
        log.info("KV cache dtype not measured (%s): %s", e, _name(DEFAULT))
        return DEFAULT
