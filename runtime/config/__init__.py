"""What a model is: its shapes, families and RoPE variants, as frozen dataclasses.

Pure data: imports neither torch, transformers nor Qt, and no other runtime package but
:mod:`runtime.errors`. Built from a transformers config object (its attributes only).
"""
from runtime.config.model import FAMILIES, ModelConfig
from runtime.config.rope import ROPE_TYPES, RopeSpec

__all__ = ["FAMILIES", "ModelConfig", "ROPE_TYPES", "RopeSpec"]
