"""Rotary position embeddings (RoPE) and their context-extension variants.

Must not import Qt. RoPE (Su et al. 2021, "RoFormer", eq. 15) rotates each pair of a
head's channels by ``position * inv_freq[i]``, ``inv_freq[i] = theta ** (-2i / d)``,
in transformers' half-split ``rotate_half`` layout (that is how transformers hands us
the weights). The variants change ``inv_freq`` (and for two of them scale cos/sin):

- ``default``: the plain formula.
- ``linear``: positions divided by ``factor`` (Chen et al. 2023, "Extending Context
  Window of Large Language Models via Positional Interpolation"): ``inv_freq / factor``.
- ``dynamic``: NTK-aware scaling (bloc97, reddit r/LocalLLaMA 2023): past the trained
  context, the base grows with the sequence length,
  ``theta * (factor * L / L_max - (factor - 1)) ** (d / (d - 2))``.
- ``yarn``: Peng et al. 2023, "YaRN" (arXiv:2309.00071): interpolated low frequencies,
  extrapolated high ones, a linear ramp between (``beta_fast``/``beta_slow``
  rotations), cos/sin scaled by ``0.1 ln(factor) + 1``.
- ``longrope``: Phi-3's (Ding et al. 2024, "LongRoPE", arXiv:2402.13753): a rescale
  factor per frequency, the short set within the trained context, the long set past
  it; cos/sin scaled by ``sqrt(1 + ln(factor) / ln(L_orig))``.
- ``llama3``: Llama 3.1's: wavelengths longer than ``L_orig / low_freq_factor`` are
  divided by ``factor``, shorter than ``L_orig / high_freq_factor`` kept, a smooth
  blend between.

Formulas as in transformers' ``modeling_rope_utils`` (the reference our tests compare
with), in float32 and in transformers' order of operations: ``inv_freq`` from a float32
power, angles ``position * inv_freq`` rounded to float32, float32 cos/sin. The model was
trained with float32 angles too (Gemma's JAX code, llama.cpp compute them so); float64
angles differ from these by up to ~1e-4 rad at position 1,200, which moved Gemma 3
270M's float32 logits 2.3e-3 away from transformers' (7.5e-5 with float32 angles;
measured on an AMD EPYC Zen 3). ``dynamic`` and ``longrope`` depend on the sequence
length: a forward over positions ``.. end-1`` uses ``seq_len = end`` for all its
tokens, as transformers does.
"""
from __future__ import annotations

import math

import torch

from runtime.config.rope import RopeSpec


def inverse_frequencies(spec: RopeSpec, head_dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``inv_freq`` ``(rotary_dim / 2,)`` float32 (radians per position) and the cos/sin scale.

    ``seq_len``: the length of the sequence so far (``dynamic``, ``longrope``); ``None``
    means within the trained context. Float32 operations in transformers' order (see the
    module docstring).
    """
    dim = spec.rotary_dim(head_dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (dim / 2,) float32
    base = spec.theta
    scale = 1.0
    if spec.type == "dynamic":
        L = max(seq_len or 0, spec.max_positions)
        base = base * ((spec.factor * L / spec.max_positions) - (spec.factor - 1)) ** (dim / (dim - 2))
    if spec.type == "yarn":
        return _yarn(base ** exponent, spec, dim)
    if spec.type == "longrope":
        factor = spec.factor or spec.max_positions / spec.original_max_positions
        long = seq_len is not None and seq_len > spec.original_max_positions
        ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32)
        scale = spec.attention_factor or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(spec.original_max_positions))
        )
        return 1.0 / (ext * base ** exponent), scale
    inv_freq = 1.0 / (base ** exponent)
    if spec.type == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.type == "llama3":
        inv_freq = _llama3(inv_freq, spec)
    return inv_freq, scale


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    old = spec.original_max_positions
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """``pos_freqs``: ``theta ** (2i / d)``, float32."""
    factor = spec.factor or spec.max_positions / spec.original_max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = spec.attention_factor
    if not attn:
        attn = (mscale(factor, spec.mscale) / mscale(factor, spec.mscale_all_dim)
                if spec.mscale and spec.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over L_orig
        return dim * math.log(spec.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    kept, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + kept * extrapolation, attn


def rope_tables(
    spec: RopeSpec, head_dim: int, start: int, end: int, *, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(end - start, rotary_dim)`` float32 for positions ``start .. end-1``.

    Each frequency appears twice (transformers' half-split layout); yarn and longrope
    tables carry their cos/sin scale.
    """
    inv_freq, scale = inverse_frequencies(spec, head_dim, seq_len)
    pos = torch.arange(start, end, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]  # (T, rotary_dim / 2), float32 angles as transformers'
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, rotary_dim)
    return emb.cos() * scale, emb.sin() * scale


def rotation_by(spec: RopeSpec, head_dim: int, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(rotary_dim,)`` of a rotation by ``delta`` positions, without the cos/sin scale.

    RoPE rotations compose, ``R(p + delta) = R(delta) R(p)``, when the frequencies do
    not depend on the position (every type but ``dynamic``/``longrope`` past the trained
    context, which a cache shift never reaches in practice).
    """
    inv_freq, _ = inverse_frequencies(spec, head_dim)
    inv_freq = inv_freq.double()
    emb = torch.cat([inv_freq, inv_freq]) * delta
    return emb.cos().float(), emb.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, H, T, D)`` by tables ``(T, R)`` already indexed by position.

    ``R < D`` (partial rotary): the first ``R`` channels are rotated, the rest pass through.
    """
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :R], x[..., R:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def shift_cached_keys(layer_ropes, head_dim: int, cache, start: int, end: int, delta: int) -> None:
    """Re-rotate ``cache``'s keys (a :class:`runtime.cache.kv_cache.KVCache`) at positions
    ``start .. end-1`` by ``delta`` positions, in place; ``layer_ropes[i]``: layer ``i``'s
    :class:`RopeSpec` (None: GPT-2).

    RoPE rotations compose: ``R(p + delta) k = R(delta) R(p) k``, so moving keys
    that were rotated at position ``p`` to ``p + delta`` needs one rotation by
    ``delta`` (used after evicting the middle of the cache), each layer with its own
    variant. GPT-2's learned absolute positions are added to the embeddings, not the
    keys: nothing to do.
    """
    if start >= end or delta == 0:
        return
    for i in range(len(cache.k)):
        spec = layer_ropes[i]
        if spec is None:
            return
        c, s = rotation_by(spec, head_dim, delta)  # (R,)
        a, b = cache.slot_range(i, start, end)
        R = c.shape[0]

        def rotate(seg: torch.Tensor, c=c, s=s, R=R) -> torch.Tensor:  # (B, Hkv, n, D) float32
            out = seg.clone()
            out[..., :R] = seg[..., :R] * c + rotate_half(seg[..., :R]) * s
            return out

        cache.transform_keys(i, a, b, rotate)
