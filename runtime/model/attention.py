"""Causal, grouped-query scaled dot-product attention: a readable reference and a fast path.

Must not import Qt. The formula (Vaswani et al. 2017, "Attention Is All You Need", eq. 1):

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shapes: q ``(B, H, Tq, D)``; k, v ``(B, Hkv, Tk, D)`` with ``H % Hkv == 0`` (grouped-query
attention, Ainslie et al. 2023: query head ``h`` reads key/value head ``h // (H // Hkv)``).
A causal query block is aligned to the END of the keys: query ``i`` of ``Tq`` sees keys
``0 .. Tk - Tq + i`` (so a block of new tokens attends to everything cached before it).

Sliding-window (local) attention (Beltagy et al. 2020, "Longformer"; Mistral, Gemma 2/3):
with ``window = W`` query ``i`` also sees only the ``W`` newest of those keys, itself
included (key ``j`` with ``Tk - Tq + i - j < W``, transformers' ``sliding_window``).
Attention logit soft-capping (Gemma 2): scores become ``c * tanh(scores / c)`` before the
mask.

:class:`Attention` at the end is the decoder's layer around these functions: the fused q/k/v
projection, head norms and RoPE, the KV cache's write and read, the hooks
(:mod:`runtime.model.hooks`), the output projection.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.cache.kv_cache import KVCache
from runtime.config.model import ModelConfig
from runtime.model.attention_rows import attention_rows
from runtime.model.hooks import AttentionHooks, Hook, edit_heads, run_hooked
from runtime.model.layers import Linear, Norm, Numerics
from runtime.model.rope import apply_rope

__all__ = [
    "attention", "attention_reference", "attention_fast", "causal_mask",
    "ATTENTION_BACKENDS", "set_attention_backend", "get_attention_backend",
    "GQA_STRATEGIES", "AttentionKernels",
]

#: ``"fast"``: torch SDPA (the default); ``"reference"``: the readable formula, step by step.
ATTENTION_BACKENDS = ("reference", "fast")
_backend = "fast"


def set_attention_backend(name: str) -> None:
    """Choose the path :func:`attention` takes, process-wide (takes effect at the next call).

    Both paths compute the same function (the tests check they agree); ``"reference"``
    is slower and exists to compare against. A plain module global, read once per call:
    switching between two decode steps is safe.

    Raises:
        ValueError: a name not in :data:`ATTENTION_BACKENDS`.
    """
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    _backend = name


def get_attention_backend() -> str:
    """The backend :func:`attention` uses now (``"fast"`` unless set)."""
    return _backend


#: How the fast path serves grouped-query attention: ``"sdpa"`` hands SDPA the KV heads
#: with ``enable_gqa``; ``"fold"`` (one query token only) folds each group's query heads
#: into the query-length axis, ``(B, Hkv, G, D)``, so a kernel without GQA support reads
#: every key/value head once. Both equal the reference path (tests).
GQA_STRATEGIES = ("sdpa", "fold")


@dataclass(frozen=True)
class AttentionKernels:
    """Which kernels the fast path uses: chosen per device by
    :func:`runtime.model.attention.attention_kernels` and passed as an argument, so every
    choice runs (and is tested) on the CPU too.

    Attributes:
        decode_gqa: one of :data:`GQA_STRATEGIES`, for a single query token.
        sdpa_backends: names of ``torch.nn.attention.SDPBackend`` members SDPA may use
            (in that order of preference), or ``None`` for torch's own choice. On CUDA
            we leave out cuDNN attention: it builds a plan for every new shape, and a
            chat's prefill shapes are all new (hundreds of ms each, measured on an H200).
    """

    decode_gqa: str = "sdpa"
    sdpa_backends: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.decode_gqa not in GQA_STRATEGIES:
            raise ValueError(f"unknown GQA strategy {self.decode_gqa!r}; use one of {', '.join(GQA_STRATEGIES)}")
        if self.sdpa_backends is not None:
            from torch.nn.attention import SDPBackend

            unknown = [b for b in self.sdpa_backends if not hasattr(SDPBackend, b)]
            if unknown or not self.sdpa_backends:
                raise ValueError(f"unknown SDPA backends {unknown or '(none given)'}; use SDPBackend names such as MATH")

    def sdpa_context(self):
        """A context manager restricting SDPA to :attr:`sdpa_backends` (a no-op without)."""
        if self.sdpa_backends is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [getattr(SDPBackend, b) for b in self.sdpa_backends]
        try:
            return sdpa_kernel(backends, set_priority=True)
        except TypeError:  # torch before 2.6: no priority order, the set alone
            return sdpa_kernel(backends)


DEFAULT_KERNELS = AttentionKernels()


def causal_mask(tq: int, tk: int, device: torch.device | str | None = None, window: int | None = None) -> torch.Tensor:
    """Boolean mask ``(Tq, Tk)``: True where query ``i`` may see key ``j`` (``j <= Tk - Tq + i``,
    and with a ``window`` also ``Tk - Tq + i - j < window``)."""
    rows = torch.arange(tq, device=device).unsqueeze(1) + (tk - tq)  # (Tq, 1): each query's own key
    cols = torch.arange(tk, device=device).unsqueeze(0)  # (1, Tk)
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least 1 token; got {window}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must agree on batch and head dim; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"more queries ({q.shape[2]}) than keys ({k.shape[2]}): the keys must include the queries' own tokens")


def _key_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None,
              window: int | None = None) -> torch.Tensor | None:
    """The boolean mask the scores get (True = may attend), broadcastable to ``(B, H, Tq, Tk)``."""
    Tq, Tk = q.shape[2], k.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask must be boolean (True = may attend); got {mask.dtype}")
    if causal:
        cm = causal_mask(Tq, Tk, q.device, window)
        return cm if mask is None else cm & mask
    return mask


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula step by step: scores, scale, (soft-cap), mask, softmax, mix.

    ``mask`` (boolean, True = may attend, broadcastable to ``(B, H, Tq, Tk)``) is
    combined with the causal mask. A masked key gets weight exactly 0; its value must
    still be finite (0 x NaN is NaN), which the KV cache's zero-filled buffers ensure.

    Returns:
        (output ``(B, H, Tq, D)`` in q's dtype, weights ``(B, H, Tq, Tk)`` in float32).
    """
    _check(q, k, v, window)
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # Each KV head serves H // Hkv query heads: repeat it for the readable path.
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, Tk, D)
    v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, Tk, D)
    scores = q.float() @ k.float().transpose(-2, -1)  # (B, H, Tq, Tk)
    scores = scores * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = _key_mask(q, k, causal, mask, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, Tq, Tk), rows sum to 1
    out = weights @ v.float()  # (B, H, Tq, D)
    return out.to(q.dtype), weights


def attention_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    kernels: AttentionKernels = DEFAULT_KERNELS,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same result as :func:`attention_reference` through torch's fused SDPA kernels.

    A sliding ``window`` first drops the keys no query of the block can see (so decode
    reads at most ``window`` keys), then masks. Soft-capping has no SDPA kernel: the
    reference formula computes it.

    Grouped-query attention never copies K/V per query head (``kernels.decode_gqa``):
    - ``"sdpa"``: SDPA's ``enable_gqa`` maps each query head to its KV head. On the
      CPU this is faster for decode than folding: the kernel splits its work by head,
      and 9 query heads share 2 cores better than 3 folded groups (118 against 134 us
      per layer at 1,024 keys for the default model, measured on an AMD EPYC Zen 4).
    - ``"fold"``, one query token: the query heads of each group are folded into the
      query-length axis, ``(B, Hkv, G, D)``, and attend to their shared K/V head.

    ``kernels.sdpa_backends`` restricts SDPA's backends. ``mask`` as in
    :func:`attention_reference`; masked slots must hold finite values (the KV cache
    zero-fills its buffers) since fused kernels may still multiply them by 0.

    Returns:
        output ``(B, H, Tq, D)`` in q's dtype.
    """
    _check(q, k, v, window)
    if softcap:
        return attention_reference(q, k, v, causal=causal, scale=scale, mask=mask, window=window, softcap=softcap)[0]
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    if causal and window is not None and Tk > Tq + window - 1:
        # The oldest query of the block sees back to key Tk - Tq - window + 1: older keys are out of every window.
        first = Tk - Tq - window + 1
        k, v = k[:, :, first:], v[:, :, first:]
        if mask is not None and mask.shape[-1] != 1:
            mask = mask[..., first:]
        Tk = k.shape[2]
    if causal and window is not None and Tq > 1 and window < Tk:
        # A band: pass it (with any given mask) explicitly.
        mask = _key_mask(q, k, True, mask, window)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    gqa = G > 1
    with kernels.sdpa_context():
        if Tq == 1 and gqa and kernels.decode_gqa == "fold":
            # A single query sees every key (it is the newest token): only ``mask`` applies.
            qg = q.reshape(B, Hkv, G, D)  # (B, Hkv, G, D): heads of one group side by side
            if mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1:
                raise ValueError("a per-head mask cannot be folded; use decode_gqa='sdpa'")
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (B, Hkv, G, D)
            return out.reshape(B, H, 1, D)  # reshape: the kernel's output may not be contiguous
        if mask is None and (not causal or Tq == 1):  # a single query is the newest token: it sees every key
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        if mask is None and Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        # A block of new queries after cached keys: SDPA's is_causal aligns to the top-left,
        # ours to the end of the keys, so pass the mask explicitly.
        allowed = _key_mask(q, k, causal and Tq > 1, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    return_weights: bool = False,
    kernels: AttentionKernels = DEFAULT_KERNELS,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, causal and grouped-query aware.

    Args:
        q: queries ``(B, H, Tq, D)``.
        k: keys ``(B, Hkv, Tk, D)``, ``H % Hkv == 0``, ``Tk >= Tq``.
        v: values ``(B, Hkv, Tk, D)``.
        causal: mask keys after each query; the query block is aligned to the end
            of the keys (query ``i`` sees keys ``<= Tk - Tq + i``).
        scale: multiplies the scores; defaults to ``1 / sqrt(D)``.
        mask: optional boolean mask (True = may attend), broadcastable to
            ``(B, H, Tq, Tk)``, combined with the causal one (the static decode step
            attends over a fixed-capacity buffer and masks the slots past the length).
        return_weights: also return the attention weights (uses the reference path).
            Otherwise the path is the one :func:`set_attention_backend` chose.
        kernels: the fast path's kernel choices (:class:`AttentionKernels`).
        window: sliding window in tokens (each query sees itself and the ``window - 1``
            keys before it); None: every earlier key. Only with ``causal``.
        softcap: soft-capping of the scaled scores, ``c * tanh(s / c)`` (Gemma 2); None: none.

    Returns:
        output ``(B, H, Tq, D)`` in q's dtype, and with ``return_weights`` also the
        weights ``(B, H, Tq, Tk)`` (float32, rows sum to 1).

    Raises:
        ValueError: shapes that do not fit the contract above; a non-boolean mask.
    """
    if return_weights:
        return attention_reference(q, k, v, causal=causal, scale=scale, mask=mask, window=window, softcap=softcap)
    if _backend == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale, mask=mask, window=window, softcap=softcap)[0]
    return attention_fast(q, k, v, causal=causal, scale=scale, mask=mask, kernels=kernels, window=window, softcap=softcap)


def attention_kernels(device: torch.device | str) -> AttentionKernels:
    """The attention fast path's kernel choices on ``device`` (every choice also runs on
    the CPU when passed explicitly; the tests do).

    - CPU: SDPA's ``enable_gqa`` for decode (faster than folding on 2 cores, see
      :func:`runtime.model.attention.attention_fast`), torch's own backend choice.
    - CUDA: decode folds each group's query heads onto the query axis, so the static
      step's masked single-query attention is plain multi-head attention that the
      memory-efficient kernel runs in one launch; SDPA may use flash, memory-efficient
      or math attention but not cuDNN's, which builds a plan per new shape (a chat's
      prefill shapes are all new: the follow-up turn on an H200 took 631 ms).
    - MPS: the fold (enable_gqa support there varies with the macOS version).
    """
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        return AttentionKernels(decode_gqa="fold", sdpa_backends=("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"))
    if dev_type == "mps":
        return AttentionKernels(decode_gqa="fold")
    return AttentionKernels()


#: A ``"weights"`` hook's callable (:mod:`runtime.model.hooks`): the layer and its attention
#: weights ``(B, H, Tq, Tk)``, or ``(B, H, 1, Tk)`` for a hook with ``last_row_only``.
AttentionObserver = Callable[[int, torch.Tensor], None]


class Attention(nn.Module):
    """Multi-head / grouped-query / multi-query self-attention with a fused q/k/v projection,
    full or sliding-window."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        #: The hooks list (the decoder's, shared by its layers; a list of its own when built alone).
        self.hooks = AttentionHooks()
        #: The decoder's numerics, shared by its layers as the hooks list is (the reproducible
        #: mode's attention: :meth:`_attend`).
        self.numerics = Numerics()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.scale = cfg.attn_scale or None
        self.softcap = cfg.attn_softcap or None
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.kernels: AttentionKernels = DEFAULT_KERNELS  # set by Decoder.set_attention_kernels
        # over each head (Qwen3, Gemma 3), or each token's whole projection (OLMo 2)
        self.qk_norm_whole = cfg.qk_norm_whole
        whole_q, whole_k = (cfg.n_heads, cfg.n_kv_heads) if cfg.qk_norm_whole else (1, 1)
        self.q_norm = Norm(cfg, whole_q * cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = Norm(cfg, whole_k * cfg.head_dim) if cfg.qk_norm else None

    @property
    def head_edit(self) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """This layer's ``"heads"`` hook: ``y = edit(layer, y)`` on the heads' outputs
        ``(B, H, T, D)`` before the output projection (:mod:`runtime.insight.ablation` sets it
        while heads are knocked out), or None."""
        hook = self.hooks.find("heads", self.layer)
        return None if hook is None else hook.fn

    @head_edit.setter
    def head_edit(self, edit: Callable[[int, torch.Tensor], torch.Tensor] | None) -> None:
        self.hooks.replace("heads", edit, self.layer)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, H, T, D)``, keys and values ``(B, Hkv, T, D)`` of the normed input
        ``x (B, T, C)``: q/k norms when the family has them (per head, or over the whole
        projection), then RoPE when ``rope``
        (cos, sin tables ``(T, R)``) is given."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hkv) D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # RMSNorm over all heads' channels together
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # RMSNorm over each head's D channels
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        layer: int,
        hooks: tuple[Hook, ...] = (),
        pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q, k, v = self.project(x, rope)
        first: int | None = 0  # position of key slot 0 (None: slots are not positions, a policy evicted)
        kw = dict(scale=self.scale, window=self.window, softcap=self.softcap)
        if pos is not None:
            # The static decode step: write at a tensor position, attend over the whole
            # fixed-capacity buffer with ``mask`` hiding the slots past the position.
            k, v = cache.write_at(layer, pos, k, v)  # (B, Hkv, capacity, D)
            y = attention(q, k, v, causal=False, mask=mask, kernels=self.kernels, scale=self.scale, softcap=self.softcap)
            if hooks:  # the decoder passes the static step only its registered hooks: no observer runs here
                y = edit_heads(hooks, layer, y)
        else:
            if cache is not None:
                first = None if cache.evicts and cache.windows[layer] is None else cache.start[layer]
                k, v = cache.update(layer, k, v)  # (B, Hkv, held + T, D); a sliding layer holds its window
            if hooks:
                y = run_hooked(hooks, layer, cache, q, k, attend=lambda: self._attend(q, k, v, first, kw),
                               formula=lambda rows: attention(rows, k, v, causal=True, return_weights=True, **kw),
                               exact=self.numerics.reproducible, scale=self.scale, softcap=self.softcap)
            else:
                y = self._attend(q, k, v, first, kw)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H D)
        return self.o_proj(y)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int | None, kw: dict) -> torch.Tensor:
        """Causal attention over the layer's keys (slot 0 at position ``first``; None after a cache
        policy's evictions): the fast path, or the reproducible mode's row-invariant one (set only
        on the CPU: :func:`runtime.loader.load.load_model` refuses it elsewhere)."""
        if self.numerics.reproducible and first is not None and q.dtype == torch.float32:
            return attention_rows(q, k.to(q.dtype), v.to(q.dtype), first=first, **kw)
        return attention(q, k, v, causal=True, kernels=self.kernels, **kw)
