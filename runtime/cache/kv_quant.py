"""The int8 KV cache's storage: quantize on write, dequantize on read (:class:`runtime.cache.kv_cache.KVCache`).

Must not import Qt. Its own module only to keep ``kv_cache.py`` readable: these methods
run on a :class:`~runtime.cache.kv_cache.KVCache` whose ``dtype`` is quantized
(``k`` / ``v`` hold int8 codes ``(B, Hkv, capacity_i, D)``, ``k_scale`` / ``v_scale``
float32 scales ``(B, Hkv, capacity_i, 1)``, :mod:`runtime.quantize`).

Each key and value vector (one token, one KV head: ``D`` numbers) is stored as ``D`` int8
codes and one float32 scale (symmetric, ``max|x| / 127``), as llama.cpp's ``q8_0`` cache
does with a scale per 32 numbers. It is quantized on write (:meth:`KVCache.update`) and
dequantized on read into one layer's scratch buffer, so attention sees the compute dtype.
Default model: 12,240 bytes per token instead of 46,080 (float32). The static decode step
runs such a cache eagerly.
"""
from __future__ import annotations

import torch

from runtime.quantize import dequantize_int8, quantize_int8


class QuantizedStorage:
    """Mixin of :class:`runtime.cache.kv_cache.KVCache`: the quantized write and read."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor]
    v_scale: list[torch.Tensor]
    _read_k: torch.Tensor | None
    _read_v: torch.Tensor | None

    def _store(self, layer: int, t0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k``, ``v`` ``(B, Hkv, T, D)`` into slots ``t0 .. t0 + T - 1`` of ``layer``."""
        t1 = t0 + k.shape[2]
        for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            q, s = quantize_int8(x)  # (B, Hkv, T, D) int8, (B, Hkv, T, 1) float32
            codes[:, :, t0:t1].copy_(q)
            scales[:, :, t0:t1].copy_(s)

    def _read(self, layer: int, t1: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``0 .. t1 - 1`` of ``layer`` dequantized to ``dtype``, ``(B, Hkv, t1, D)``:
        views of one pair of read buffers shared by every layer, valid until the next read
        (the caller drops them whenever the cache grows)."""
        if self._read_k is None or self._read_k.dtype != dtype:
            b, h, _, d = self.k[0].shape
            shape = (b, h, max(kb.shape[2] for kb in self.k), d)  # the largest layer's buffer
            self._read_k, self._read_v = (torch.empty(shape, dtype=dtype, device=self.k[0].device) for _ in range(2))
        k = dequantize_int8(self.k[layer][:, :, :t1], self.k_scale[layer][:, :, :t1], dtype, out=self._read_k[:, :, :t1])
        v = dequantize_int8(self.v[layer][:, :, :t1], self.v_scale[layer][:, :, :t1], dtype, out=self._read_v[:, :, :t1])
        return k, v

    def _transform_quantized(self, layer: int, a: int, b: int, fn) -> None:
        """Keys in slots ``a .. b-1`` of ``layer`` replaced by ``fn(float32 keys)``, requantized."""
        kb, sb = self.k[layer], self.k_scale[layer]
        q, s = quantize_int8(fn(dequantize_int8(kb[:, :, a:b], sb[:, :, a:b])))
        kb[:, :, a:b].copy_(q)
        sb[:, :, a:b].copy_(s)
