"""attnchat's runtime: our decoder, attention, KV cache, sampling and chat sessions.

torch + transformers; never Qt. This module is the public API the desktop and the
command line use. Nothing runs at import time.
"""
from runtime.cache.policies import CACHE_POLICIES, PolicyParams
from runtime.cache.policies.evictor import Evictor, budget_for_bytes
from runtime.cache.kv_cache import KVCache
from runtime.cache.policies.figures import MEASURED as CACHE_POLICY_FIGURES
from runtime.memory.planner import Fit, MemoryPlan, count_parameters, plan, plan_for_config
from runtime.memory.sizes import cache_bytes_per_token, element_bytes, kv_bytes_per_token
from runtime.config.model import ModelConfig
from runtime.device import (
    WEIGHT_DTYPE_QUALITY,
    DeviceProfile,
    available_devices,
    compute_dtype,
    default_cache_dtype,
    default_dtype,
    device_profile,
    free_memory_bytes,
    resolve_device,
)
from runtime.dtypes import CACHE_DTYPES
from runtime.errors import (
    AttnchatError,
    CacheLimitError,
    ChatTemplateError,
    ContextOverflowError,
    DeviceError,
    ModelFileChanged,
    ModelLoadError,
    UnsupportedModelError,
)
from runtime.generate.chat_format import Message, builtin_system_prompt
from runtime.generate.context import OVERFLOW_POLICIES
from runtime.generate.events import (
    Event,
    Finish,
    GenerationSettings,
    LogitsProcessor,
    PrefillProgress,
    StatsUpdate,
    TextPiece,
    TurnStats,
)
from runtime.generate.sampling import SamplingParams
from runtime.generate.session import ChatSession
from runtime.insight.ablation import (
    ABLATION_MODES,
    InductionAblation,
    ablated,
    induction_ablation,
    parse_heads,
    top_and_probs,
)
from runtime.insight.attention_view import (
    FormulaSteps,
    LayerAttention,
    context_ids,
    conversation_ids,
    held_context,
    kept_share,
    token_strings,
)
from runtime.insight.context_cost import (
    AttentionStepTime,
    attention_step_seconds,
    scores_per_head,
)
from runtime.insight.explain import (
    IG_POSITIONS,
    IG_STEPS,
    ExplainCancelled,
    Explanation,
    explain_cost,
    explain_token,
    explain_rate,
    explain_work,
    kendall_tau,
    reply_positions,
)
from runtime.insight.formula import FormulaByHand, formula_by_hand
from runtime.insight.probe import AttentionCapture, HeadScores, head_scores
from runtime.loader.load import gguf_blocks_bytes, load_model, read_config
from runtime.loader.model import Model
from runtime.loader.load import cache_dtype_for
from runtime.loader.support import QuantSupport, fit, quant_support, runs_from_blocks
from runtime.model.attention import (
    ATTENTION_BACKENDS,
    attention,
    get_attention_backend,
    set_attention_backend,
)

__all__ = [
    "attention", "ATTENTION_BACKENDS", "set_attention_backend", "get_attention_backend", "available_devices", "resolve_device", "compute_dtype", "default_cache_dtype", "cache_dtype_for", "default_dtype", "DeviceProfile", "device_profile", "WEIGHT_DTYPE_QUALITY", "Message", "builtin_system_prompt", "ModelConfig", "KVCache", "CACHE_POLICIES", "CACHE_POLICY_FIGURES", "PolicyParams", "Evictor", "budget_for_bytes", "CACHE_DTYPES", "Model", "load_model",
    "SamplingParams", "Fit", "fit", "runs_from_blocks", "MemoryPlan", "plan", "plan_for_config", "kv_bytes_per_token", "cache_bytes_per_token", "count_parameters", "element_bytes",
    "free_memory_bytes", "AttentionCapture", "HeadScores", "head_scores",
    "ABLATION_MODES", "InductionAblation", "ablated", "induction_ablation", "parse_heads", "top_and_probs",
    "AttentionStepTime", "attention_step_seconds", "scores_per_head", "Explanation", "ExplainCancelled", "explain_cost", "explain_rate", "explain_token", "explain_work", "IG_POSITIONS", "IG_STEPS", "kendall_tau",
    "reply_positions", "FormulaByHand", "formula_by_hand",
    "LayerAttention", "FormulaSteps", "context_ids", "conversation_ids", "held_context", "kept_share", "token_strings", "read_config", "gguf_blocks_bytes", "QuantSupport", "quant_support", "ChatSession", "GenerationSettings", "OVERFLOW_POLICIES", "Event",
    "PrefillProgress", "TextPiece", "StatsUpdate", "Finish", "TurnStats",
    "AttnchatError", "CacheLimitError", "ChatTemplateError", "ContextOverflowError", "DeviceError", "ModelFileChanged",
    "ModelLoadError", "UnsupportedModelError",
]
