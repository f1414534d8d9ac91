"""attnchat's runtime: our decoder, attention, KV cache, sampling and chat sessions.

torch + transformers; never Qt. This module is the public API the desktop and the
command line use. Nothing runs at import time.
"""
from runtime.attention import ATTENTION_BACKENDS, attention, get_attention_backend, set_attention_backend
from runtime.chat_format import Message, builtin_system_prompt
from runtime.config import ModelConfig
from runtime.device import WEIGHT_DTYPE_QUALITY, available_devices, compute_dtype, default_dtype
from runtime.errors import (
    AttnchatError,
    CacheLimitError,
    ContextOverflowError,
    DeviceError,
    ModelLoadError,
    UnsupportedModelError,
)
from runtime.dtypes import CACHE_DTYPES
from runtime.kv_cache import KVCache
from runtime.loader import Model, load_model, read_config
from runtime.memory import MemoryPlan, cache_bytes_per_token, count_parameters, element_bytes, free_memory_bytes, kv_bytes_per_token, plan, plan_for_config
from runtime.attention_view import FormulaSteps, LayerAttention, context_ids, conversation_ids, token_strings
from runtime.probe import AttentionCapture, HeadScores, head_scores
from runtime.ablation import ABLATION_MODES, InductionAblation, ablated, induction_ablation, parse_heads, top_and_probs
from runtime.context_cost import AttentionStepTime, attention_step_seconds, scores_per_head
from runtime.explain import Explanation, explain_token, kendall_tau, reply_positions
from runtime.formula import FormulaByHand, formula_by_hand
from runtime.sampling import SamplingParams
from runtime.session import (
    OVERFLOW_POLICIES,
    ChatSession,
    Event,
    Finish,
    GenerationSettings,
    LogitsProcessor,
    PrefillProgress,
    StatsUpdate,
    TextPiece,
    TurnStats,
)

__all__ = [
    "attention", "ATTENTION_BACKENDS", "set_attention_backend", "get_attention_backend", "available_devices", "compute_dtype", "default_dtype", "WEIGHT_DTYPE_QUALITY", "Message", "builtin_system_prompt", "ModelConfig", "KVCache", "CACHE_DTYPES", "Model", "load_model",
    "SamplingParams", "MemoryPlan", "plan", "plan_for_config", "kv_bytes_per_token", "cache_bytes_per_token", "count_parameters", "element_bytes",
    "free_memory_bytes", "AttentionCapture", "HeadScores", "head_scores",
    "ABLATION_MODES", "InductionAblation", "ablated", "induction_ablation", "parse_heads", "top_and_probs",
    "AttentionStepTime", "attention_step_seconds", "scores_per_head", "Explanation", "explain_token", "kendall_tau",
    "reply_positions", "FormulaByHand", "formula_by_hand",
    "LayerAttention", "FormulaSteps", "context_ids", "conversation_ids", "token_strings", "read_config", "ChatSession", "GenerationSettings", "OVERFLOW_POLICIES", "Event",
    "PrefillProgress", "TextPiece", "StatsUpdate", "Finish", "TurnStats",
    "AttnchatError", "CacheLimitError", "ContextOverflowError", "DeviceError",
    "ModelLoadError", "UnsupportedModelError",
]
