"""attnchat's runtime: our decoder, attention, KV cache, sampling and chat sessions.

torch + transformers; never Qt. Public API: :func:`load_model`, :class:`Model`,
:func:`attention`, :class:`KVCache`, the typed errors. Nothing runs at import time.
"""
from runtime.attention import attention
from runtime.config import ModelConfig
from runtime.errors import (
    AttnchatError,
    CacheLimitError,
    ContextOverflowError,
    DeviceError,
    ModelLoadError,
    UnsupportedModelError,
)
from runtime.kv_cache import KVCache
from runtime.loader import Model, load_model

__all__ = [
    "attention", "ModelConfig", "KVCache", "Model", "load_model",
    "AttnchatError", "CacheLimitError", "ContextOverflowError", "DeviceError",
    "ModelLoadError", "UnsupportedModelError",
]
