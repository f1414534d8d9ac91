"""Attention whose every query row is computed the same way however many queries come
together: the reproducible mode's attention.

Must not import Qt.

torch's fused attention (SDPA) picks its blocking by the number of queries and keys, so a
token's output differs in the last bits between a prefill chunk and a one-token step
(measured: up to 6e-7 on the default model's shapes, Intel Xeon), and the reply's
greedy tokens can then differ between a reply and its Regenerate. Here every query sees
its keys in fixed blocks of :data:`BLOCK` positions, aligned to absolute positions:

1. scores per block: ``q_rows (M, D) @ k_block (BLOCK, D).T`` with the row-invariant
   product (:func:`runtime.kernels.invariant.rows_product`: the same bits for a row
   whatever ``M``), scaled, soft-capped, masked (later keys, keys outside a sliding
   window, slots past the keys given: ``-inf``);
2. each row's maximum over all its blocks (exact in any order);
3. ``p = exp(s - max)`` (elementwise; ``torch.exp`` gives the same bits in its vector
   body and scalar tail, checked by the tests);
4. ``[p @ v | sum p]`` per block with the same product (the sum rides as a column of ones
   beside ``v``), added block after block in position order: a block a query cannot see
   adds exact zeros, so a prefill's extra blocks change nothing and a decode step's
   blocks give the same sums;
5. output = accumulated ``p @ v`` / accumulated ``sum p``.

So a query's output depends only on its row, its keys and its position: the same in one
prefill, in chunks, and one token at a time, at any thread count under which the product
is row-invariant. Slower than SDPA (two small products per KV head and block instead of
one fused kernel; measured in ``attnchat bench``), which is why it is a setting.
"""
from __future__ import annotations

import math

import torch

from runtime.kernels.invariant import rows_product

#: Keys per block. Divides the KV cache's growth chunk (256), so a block is a view of the
#: cache's buffer except the last, partly filled one.
BLOCK = 256


def _block(t: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """Slots ``lo .. lo + BLOCK - 1`` of ``t (Hkv, n, D)``: a view when all exist, else a
    zero-padded copy (slots before 0 or past ``n`` are masked anyway)."""
    a, b = max(lo, 0), min(lo + BLOCK, n)
    if a == lo and b == lo + BLOCK:
        return t[:, a:b]
    out = t.new_zeros((t.shape[0], BLOCK, t.shape[2]))
    if b > a:
        out[:, a - lo : b - lo] = t[:, a:b]
    return out


def attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    first: int = 0,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention of ``q (B, H, Tq, D)`` over ``k, v (B, Hkv, Tk, D)``
    (float32), the newest ``Tq`` keys being the queries' own; key slot ``j`` holds position
    ``first + j`` (a sliding layer's cache drops older slots).

    Same contract as :func:`runtime.model.attention.attention` with ``causal=True`` and no
    mask; the result is ``(B, H, Tq, D)`` float32.
    """
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q0 = first + Tk - Tq  # position of the first query
    qpos = torch.arange(q0, q0 + Tq, device=q.device).repeat(G)  # (G Tq,): rows are (head in group, query)
    lowest = q0 - window + 1 if window is not None else 0
    b0 = max(lowest, first, 0) // BLOCK  # first block any query can see
    b1 = (q0 + Tq - 1) // BLOCK  # block of the newest query
    out = q.new_empty((B, H, Tq, D))
    ones = None
    for b in range(B):
        rows = q[b].reshape(Hkv, G * Tq, D)  # (Hkv, G Tq, D): each KV head's queries
        if rows.stride(-1) != 1 or not rows.is_contiguous():
            rows = rows.contiguous()
        kb, vb = k[b], v[b]  # (Hkv, Tk, D)
        scores = []
        for c in range(b0, b1 + 1):
            lo = c * BLOCK - first  # slot of the block's first position
            kc = _block(kb, lo, Tk)  # (Hkv, BLOCK, D)
            s = torch.stack([rows_product(rows[h], kc[h]) for h in range(Hkv)])  # (Hkv, G Tq, BLOCK)
            scores.append(s)
        s = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]  # (Hkv, G Tq, nblocks BLOCK)
        s = s * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        kpos = torch.arange(b0 * BLOCK, (b1 + 1) * BLOCK, device=q.device)  # (nblocks BLOCK,)
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= first) & (kpos[None, :] < first + Tk)
        if window is not None:
            visible &= kpos[None, :] > qpos[:, None] - window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))  # (Hkv, G Tq, nblocks BLOCK)
        if ones is None:
            ones = q.new_ones((Hkv, 1, BLOCK))
        acc = None
        for i, c in enumerate(range(b0, b1 + 1)):
            vc = _block(vb, c * BLOCK - first, Tk)  # (Hkv, BLOCK, D)
            vt = torch.cat([vc.transpose(1, 2), ones], dim=1)  # (Hkv, D + 1, BLOCK): v's columns and a row of ones
            pc = p[:, :, i * BLOCK : (i + 1) * BLOCK].contiguous()
            part = torch.stack([rows_product(pc[h], vt[h]) for h in range(Hkv)])  # (Hkv, G Tq, D + 1)
            acc = part if acc is None else acc + part
        y = acc[..., :D] / acc[..., D:]  # (Hkv, G Tq, D)
        out[b] = y.reshape(H, Tq, D)
    return out
