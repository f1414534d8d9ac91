"""attnchat's runtime: our decoder, attention, KV cache, sampling and chat sessions.

torch + transformers; never Qt. This module is the public API the desktop and the
command line use. Nothing runs at import time.
"""
from runtime.attention import attention
from runtime.chat_format import Message
from runtime.config import ModelConfig
from runtime.errors import (
    AttnchatError,
    CacheLimitError,
    ContextOverflowError,
    DeviceError,
    ModelLoadError,
    UnsupportedModelError,
)
from runtime.kv_cache import CACHE_DTYPES, KVCache
from runtime.loader import Model, load_model, read_config
from runtime.memory import MemoryPlan, count_parameters, free_memory_bytes, kv_bytes_per_token, plan, plan_for_config
from runtime.probe import AttentionCapture, HeadScores, head_scores
from runtime.sampling import SamplingParams
from runtime.session import (
    OVERFLOW_POLICIES,
    ChatSession,
    Event,
    Finish,
    GenerationSettings,
    PrefillProgress,
    StatsUpdate,
    TextPiece,
    TurnStats,
)

__all__ = [
    "attention", "Message", "ModelConfig", "KVCache", "CACHE_DTYPES", "Model", "load_model",
    "SamplingParams", "MemoryPlan", "plan", "plan_for_config", "kv_bytes_per_token", "count_parameters",
    "free_memory_bytes", "AttentionCapture", "HeadScores", "head_scores", "read_config", "ChatSession", "GenerationSettings", "OVERFLOW_POLICIES", "Event",
    "PrefillProgress", "TextPiece", "StatsUpdate", "Finish", "TurnStats",
    "AttnchatError", "CacheLimitError", "ContextOverflowError", "DeviceError",
    "ModelLoadError", "UnsupportedModelError",
]
