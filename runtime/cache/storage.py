"""How the KV cache stores its vectors: as floats, or as int8 codes with a scale each.

Must not import Qt. A :class:`runtime.cache.kv_cache.KVCache` owns one of these (its ``storage``)
and decides which slots to write, move, gather or read; the storage holds the per-layer buffers
(its *planes*) and knows what a write and a read cost in its format.

- :class:`FloatStorage`: ``k`` / ``v`` hold the vectors ``(B, Hkv, capacity_i, D)`` in the
  cache's dtype (float32, bfloat16, float16).
- :class:`Int8Storage`: each key and value vector (one token, one KV head: ``D`` numbers) is
  ``D`` int8 codes and one float32 scale (symmetric, ``max|x| / 127``, :mod:`runtime.quantize`),
  as llama.cpp's ``q8_0`` cache does with a scale per 32 numbers: ``k`` / ``v`` hold the codes,
  ``k_scale`` / ``v_scale`` the scales ``(B, Hkv, capacity_i, 1)``. Quantized on write,
  dequantized on read into one layer's scratch buffer, so attention sees the compute dtype.
  Default model: 12,240 bytes per token instead of 46,080 (float32). The static decode step
  runs such a cache eagerly.

Buffers are normal tensors (no autograd history, writable from any caller), since a compiled
decode step cannot write into views of inference tensors; they are zero-filled because the
static decode step attends over the whole buffer and masks the unused slots, and a masked NaN
still poisons (0 x NaN).
"""
from __future__ import annotations

import torch

from runtime.dtypes import QUANTIZED_CACHE_DTYPES, dtype_name
from runtime.quantize import dequantize_int8, quantize_int8


class FloatStorage:
    """Per-layer K/V buffers ``(B, Hkv, capacity_i, D)`` of ``dtype`` on ``device``.

    Args:
        batch, n_kv_heads, head_dim: the buffers' shape but for the slots.
        dtype: a float dtype; device: where the buffers live.
    """

    quantized = False

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.n_kv_heads, self.head_dim = batch, n_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # The per-layer buffer lists: changed in place, never rebound (the cache shares them).
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # int8 only
        self.v_scale: list[torch.Tensor] = []

    # ---- the buffers ------------------------------------------------------------------
    def planes(self) -> tuple[list[torch.Tensor], ...]:
        """The per-layer buffer lists (K and V; then their scales for int8)."""
        return (self.k, self.v)

    def _zeros(self, tokens: int, scale: bool) -> torch.Tensor:
        """A zeroed ``(B, Hkv, tokens, D)`` buffer, or ``(B, Hkv, tokens, 1)`` float32 scales (a normal tensor)."""
        shape = (self.batch, self.n_kv_heads, tokens, 1 if scale else self.head_dim)
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=torch.float32 if scale else self.dtype, device=self.device)

    def resize(self, layer: int, tokens: int, n: int) -> None:
        """Give layer ``layer`` buffers of ``tokens`` slots (a new layer: appended), its first
        ``n`` slots copied over. Every plane is allocated before any is replaced, so a failed
        allocation leaves the layer as it was.

        Raises:
            torch.OutOfMemoryError, RuntimeError: the allocation failed (RuntimeError: the CPU allocator).
        """
        planes = self.planes()
        new = [self._zeros(tokens, scale) for scale in (False, False, True, True)[: len(planes)]]
        for plane, buf in zip(planes, new):
            if layer < len(plane):
                buf[:, :, :n].copy_(plane[layer][:, :, :n])
                plane[layer] = buf
            else:
                plane.append(buf)
        self.invalidate()

    def move(self, layer: int, src: int, dst: int, n: int) -> None:
        """Copy slots ``src .. src + n - 1`` of layer ``layer`` to ``dst ..`` in every plane."""
        for plane in self.planes():
            buf = plane[layer]
            buf[:, :, dst : dst + n].copy_(buf[:, :, src : src + n].clone())  # clone: they may overlap

    def gather(self, layer: int, idx: torch.Tensor, held: int) -> None:
        """Slots ``idx`` ``(B, Hkv, n)`` of the first ``held`` moved to ``0 .. n - 1``, per KV head, in every plane."""
        n = idx.shape[-1]
        for plane in self.planes():
            buf = plane[layer]
            buf[:, :, :n].copy_(buf[:, :, :held].gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])))
        self.invalidate()

    def clear(self) -> None:
        """Free every buffer."""
        for plane in self.planes():
            plane.clear()
        self.invalidate()

    def invalidate(self) -> None:
        """Forget scratch buffers sized for the old buffers (int8 only)."""

    # ---- writes and reads ---------------------------------------------------------------
    def write(self, layer: int, t0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``(B, Hkv, T, D)`` in slots ``t0 .. t0 + T - 1``; returns the layer's
        slots ``0 .. t0 + T - 1`` as keys and values in ``k``'s dtype, ``(B, Hkv, t0 + T, D)``."""
        t1 = t0 + k.shape[2]
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, t0:t1].copy_(k)
        vb[:, :, t0:t1].copy_(v)
        return kb[:, :, :t1], vb[:, :, :t1]

    def write_at(self, layer: int, pos: torch.Tensor, capacity: int, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The static decode step's write: one token ``(B, Hkv, 1, D)`` at slot ``pos`` (a ``(1,)``
        int64 tensor); returns the layer's first ``capacity`` slots."""
        kb, vb = self.k[layer][:, :, :capacity], self.v[layer][:, :, :capacity]
        kb.index_copy_(2, pos, k.to(kb.dtype))
        vb.index_copy_(2, pos, v.to(vb.dtype))
        return kb, vb

    def transform_keys(self, layer: int, a: int, b: int, fn) -> None:
        """Keys in slots ``a .. b-1`` replaced by ``fn(float32 keys)`` (stored back in the dtype)."""
        kb = self.k[layer]
        kb[:, :, a:b] = fn(kb[:, :, a:b].float()).to(kb.dtype)

    def read_keys(self, layer: int, n: int) -> torch.Tensor:
        """Slots ``0 .. n - 1`` of layer ``layer``'s keys as float32 ``(B, Hkv, n, D)``."""
        return self.k[layer][:, :, :n].float()


class Int8Storage(FloatStorage):
    """Int8 codes ``k`` / ``v`` ``(B, Hkv, capacity_i, D)`` with float32 scales ``k_scale`` /
    ``v_scale`` ``(B, Hkv, capacity_i, 1)`` (see the module)."""

    quantized = True

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(batch, n_kv_heads, head_dim, dtype, device)
        # Dequantized keys and values of the layer being read: one layer's worth, reused by every
        # layer, in the dtype the model computes in.
        self._read_k: torch.Tensor | None = None
        self._read_v: torch.Tensor | None = None

    def planes(self) -> tuple[list[torch.Tensor], ...]:
        return (self.k, self.v, self.k_scale, self.v_scale)

    def invalidate(self) -> None:
        self._read_k = self._read_v = None  # re-made at the new size on the next read

    def write(self, layer: int, t0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``k``, ``v`` ``(B, Hkv, T, D)`` into slots ``t0 .. t0 + T - 1``; returns slots
        ``0 .. t0 + T - 1`` dequantized to ``k``'s dtype: views of the shared read buffers, valid
        until the next read."""
        t1 = t0 + k.shape[2]
        for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            q, s = quantize_int8(x)  # (B, Hkv, T, D) int8, (B, Hkv, T, 1) float32
            codes[:, :, t0:t1].copy_(q)
            scales[:, :, t0:t1].copy_(s)
        return self._read(layer, t1, k.dtype)

    def _read(self, layer: int, t1: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._read_k is None or self._read_k.dtype != dtype:
            b, h, _, d = self.k[0].shape
            shape = (b, h, max(kb.shape[2] for kb in self.k), d)  # the largest layer's buffer
            self._read_k, self._read_v = (torch.empty(shape, dtype=dtype, device=self.k[0].device) for _ in range(2))
        k = dequantize_int8(self.k[layer][:, :, :t1], self.k_scale[layer][:, :, :t1], dtype, out=self._read_k[:, :, :t1])
        v = dequantize_int8(self.v[layer][:, :, :t1], self.v_scale[layer][:, :, :t1], dtype, out=self._read_v[:, :, :t1])
        return k, v

    def write_at(self, layer, pos, capacity, k, v):
        raise ValueError(f"write_at: a {dtype_name(self.dtype)} cache is written by update(), not by the static step")

    def transform_keys(self, layer: int, a: int, b: int, fn) -> None:
        kb, sb = self.k[layer], self.k_scale[layer]
        q, s = quantize_int8(fn(dequantize_int8(kb[:, :, a:b], sb[:, :, a:b])))
        kb[:, :, a:b].copy_(q)
        sb[:, :, a:b].copy_(s)

    def read_keys(self, layer: int, n: int) -> torch.Tensor:
        return dequantize_int8(self.k[layer][:, :, :n], self.k_scale[layer][:, :, :n])


def storage_for(dtype: torch.dtype, batch: int, n_kv_heads: int, head_dim: int, device: torch.device) -> FloatStorage:
    """The storage for a cache of ``dtype``: :class:`Int8Storage` for a quantized dtype, else :class:`FloatStorage`."""
    cls = Int8Storage if dtype in QUANTIZED_CACHE_DTYPES else FloatStorage
    return cls(batch, n_kv_heads, head_dim, dtype, device)
