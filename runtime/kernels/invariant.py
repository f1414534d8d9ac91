"""Products whose rows do not depend on how many rows are computed together: what makes a
greedy reply the same whether its tokens came from one prefill, chunks, one-token steps or
a reused cache.

Must not import Qt. Nothing runs at import time.

Why: a library's matrix product picks its algorithm by shape. For one row it runs a
matrix-vector kernel that splits each dot product over vector lanes; for several rows a
matrix-matrix kernel that accumulates each output in another order. The two differ in the
last bits (measured on an Intel Xeon, 2 threads, the default model's matrices: oneDNN's
inner product, one row against the same row among 2-512: up to 7.6e-6 apart; MKL's also
between 2-15 rows and 16+, and with 2 threads between 16-33 and 64-128 rows), and a near-tie
between two tokens then flips (llama.cpp has the same bug, ggml-org/llama.cpp#4902;
He et al., Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

The rule (:data:`RULE`), for every kernel that serves the reproducible mode:

1. one kernel for every row count (no separate one-row kernel);
2. a single row goes through it as the first of two (a zero row beside it), so the kernel's
   own one-row path never runs;
3. the kernel's rows are then *row-invariant*: row ``i`` of a product of ``M >= 2`` rows is
   bitwise the same for every ``M`` and every thread count the governors may choose.
   :func:`rows_invariant` checks this on a kernel and a matrix; the kernel choice checks it
   on the model's own matrices before it offers a kernel for the reproducible mode, and the
   tests check it for every kernel that claims it.

oneDNN's float32 inner product holds (3) for every shape we measured (M 2-2048, 1 and 2
threads, the default model's six matrix shapes and the attention's 64- and 256-wide
blocks); MKL's does not. A quantized kernel (GGUF blocks) joins by computing its rows the
same way: through :func:`two_rows` for one row and one function for any row count.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

RULE = ("one kernel for every row count; one row computed as the first of two; the kernel's rows "
        "bitwise the same for any row count >= 2 and any thread count (runtime.kernels.invariant)")

#: Row counts :func:`rows_invariant` compares (one prefill chunk is 256 by default; 2-3 are a
#: decode step's attention rows; odd counts catch tail handling).
CHECK_ROWS = (2, 3, 5, 9, 16, 33, 64, 257)


def two_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for ``x (..., M, in)`` with a single row computed as the first of two.

    ``fn`` takes a 2-D ``(rows, in)`` tensor and returns ``(rows, out)``; the result has
    ``x``'s leading shape. For ``M >= 2`` this is ``fn`` on the rows as they are.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 1:
        y = fn(torch.cat([x2, torch.zeros_like(x2)]))[:1]
    else:
        y = fn(x2 if x2.is_contiguous() else x2.contiguous())
    return y.reshape(*shape[:-1], y.shape[-1])


def onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x (M, in) @ weight (out, in).T (+ bias)`` through oneDNN's inner product
    (``F.linear`` where this torch has none: then nothing is promised, see
    :func:`runtime.kernels.onednn.linear_op`). Call it through :func:`two_rows`."""
    from runtime.kernels import onednn

    op = onednn.linear_op(torch.float32)
    if op is None:
        return torch.nn.functional.linear(x, weight, bias)
    return op(x, weight, bias, "none", [None], "")


def rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row-invariant float32 ``x (..., in) @ weight (out, in).T``: :func:`onednn_rows` with one
    row computed as two. The attention's blocks use it (:mod:`runtime.model.attention_rows`)."""
    return two_rows(lambda x2: onednn_rows(x2, weight), x)


def rows_invariant(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    *,
    rows: Iterable[int] = CHECK_ROWS,
    threads: Iterable[int] = (),
    seed: int = 0,
) -> list[str]:
    """Check :data:`RULE` on ``fn`` (2-D ``(rows, in)`` float32 -> ``(rows, out)``, computing a
    single row as the rule has it: e.g. :func:`runtime.kernels.choice.apply` with a
    reproducible choice, or a kernel wrapped in :func:`two_rows`).

    One row and every row count in ``rows`` are compared bitwise with the rows of the
    largest product, under each thread count in ``threads`` (the current count when
    empty; restored after).

    Returns:
        the failures, one line each (``"5 rows, 2 threads: 3.8e-06 apart"``); empty when
        the rule holds.
    """
    rows = sorted(set(rows))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows[-1], in_features, generator=g)
    before = torch.get_num_threads()
    counts = list(threads) or [before]
    failures = []
    try:
        with torch.inference_mode():
            want = None
            for t in counts:
                torch.set_num_threads(t)
                full = fn(x)
                if want is None:
                    want = full
                tried = [(m, fn(x[:m].contiguous())) for m in rows[:-1]]
                tried.append((1, fn(x[:1])))
                tried.append((rows[-1], full))
                for m, got in tried:
                    if not torch.equal(got, want[:m]):
                        gap = (got - want[:m]).abs().max().item()
                        failures.append(f"{m} rows, {t} threads: {gap:.1e} apart")
    finally:
        torch.set_num_threads(before)
    return failures
