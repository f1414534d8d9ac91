"""A RoPE variant and its parameters, as read from a transformers config (pure data).

Must not import torch or Qt. The tables and rotations are :mod:`runtime.model.rope`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from runtime.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


#: Variants whose frequencies depend on the sequence length.
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE variant and its parameters (transformers' ``rope_parameters`` names).

    Attributes:
        type: one of :data:`ROPE_TYPES`.
        theta: the base.
        factor: context-extension factor (``linear``, ``dynamic``, ``yarn``, ``llama3``;
            ``longrope`` derives it when absent: 0 here).
        original_max_positions: the context the model was first trained for (tokens).
        max_positions: the model's maximum context (tokens; ``dynamic`` and ``longrope``).
        low_freq_factor, high_freq_factor: ``llama3``'s band edges.
        beta_fast, beta_slow: ``yarn``'s ramp, in rotations.
        attention_factor: cos/sin scale (``yarn``, ``longrope``); 0: derived.
        mscale, mscale_all_dim: ``yarn``'s DeepSeek form of that scale (0: unused).
        truncate: ``yarn`` rounds the ramp's ends to whole dimensions.
        long_factor, short_factor: ``longrope``'s per-frequency factors.
        partial_rotary_factor: the fraction of each head that is rotated (Phi-4-mini: 0.75).
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float = 0.0
    original_max_positions: int = 0
    max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, params: dict | None, *, max_positions: int, partial_rotary_factor: float = 1.0) -> "RopeSpec":
        """From one transformers ``rope_parameters`` dict (or the older ``rope_scaling``).

        Raises:
            UnsupportedModelError: a RoPE type not in :data:`ROPE_TYPES`, or one missing a
                parameter it needs.
        """
        p = dict(params or {})
        rope_type = p.get("rope_type", p.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling {rope_type!r} is not supported; attnchat runs {', '.join(ROPE_TYPES)}"
            )
        orig = p.get("original_max_position_embeddings") or max_positions
        try:
            spec = cls(
                type=rope_type,
                theta=float(p.get("rope_theta") or 10000.0),
                factor=float(p.get("factor") or 0.0),
                original_max_positions=int(orig),
                max_positions=int(max_positions),
                low_freq_factor=float(p.get("low_freq_factor", 1.0)),
                high_freq_factor=float(p.get("high_freq_factor", 4.0)),
                beta_fast=float(p.get("beta_fast") or 32.0),
                beta_slow=float(p.get("beta_slow") or 1.0),
                attention_factor=float(p.get("attention_factor") or 0.0),
                mscale=float(p.get("mscale") or 0.0),
                mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
                truncate=bool(p.get("truncate", True)),
                long_factor=tuple(float(x) for x in p.get("long_factor") or ()),
                short_factor=tuple(float(x) for x in p.get("short_factor") or ()),
                partial_rotary_factor=float(p.get("partial_rotary_factor", partial_rotary_factor) or 1.0),
            )
        except (TypeError, ValueError) as e:
            raise UnsupportedModelError(f"RoPE parameters {p} could not be read ({e})") from None
        if rope_type in ("linear", "dynamic", "llama3") and spec.factor <= 0:
            raise UnsupportedModelError(f"RoPE scaling {rope_type!r} needs a positive factor; the config has none")
        if rope_type == "longrope" and not (spec.long_factor and spec.short_factor):
            raise UnsupportedModelError("RoPE scaling 'longrope' needs long_factor and short_factor; the config lacks them")
        return spec

    @classmethod
    def from_dict(cls, d: dict) -> "RopeSpec":
        """From :func:`dataclasses.asdict` output (a JSON round trip: lists back to tuples)."""
        names = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)

    def rotary_dim(self, head_dim: int) -> int:
        """Channels of a head that are rotated (the rest pass through)."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def length_dependent(self) -> bool:
        return self.type in LENGTH_DEPENDENT
