"""The memory planner: weights bytes, KV-cache bytes per token and at a context, what fits a budget.

Must not import Qt. Works from a loaded model's config or from bare numbers, so a user
can check a bigger model before fetching it.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element
(the cache stores one key and one value vector per KV head per layer per token).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from runtime.config import ModelConfig
from runtime.device import default_dtype
from runtime.dtypes import dtype_name, parse_cache_dtype


def element_bytes(dtype: str | torch.dtype) -> int:
    """Bytes of one element of a cache or weight dtype (float32: 4, bfloat16/float16: 2)."""
    return parse_cache_dtype(dtype).itemsize


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """2 x layers x KV heads x head dim x bytes per element.

    Raises:
        ValueError: a non-positive number.
    """
    for name, value in (("layers", layers), ("KV heads", kv_heads), ("head dim", head_dim), ("bytes per element", elem_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be positive; got {value}")
    return 2 * layers * kv_heads * head_dim * elem_bytes


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of a decoder described by ``cfg`` (tied embeddings counted once).

    Llama family: embeddings V x C; per layer q/k/v/o (C x (H + 2 Hkv) D + H D x C,
    plus biases), SwiGLU 3 x C x I, two RMSNorm weights; final norm; LM head unless tied.
    GPT-2: the same plus learned positions, LayerNorm biases and a 2-matrix GELU MLP.
    """
    C, V, L, I = cfg.hidden_size, cfg.vocab_size, cfg.n_layers, cfg.intermediate_size
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv_out = (H + 2 * Hkv) * D
    per_layer = C * qkv_out + H * D * C
    per_layer += qkv_out if cfg.qkv_bias else 0
    per_layer += C if cfg.o_bias else 0
    if cfg.family == "llama":
        per_layer += 3 * C * I + (2 * I + C if cfg.mlp_bias else 0) + 2 * C
        total = V * C + L * per_layer + C
    else:
        per_layer += 2 * C * I + (I + C if cfg.mlp_bias else 0) + 4 * C
        total = V * C + cfg.max_position_embeddings * C + L * per_layer + 2 * C
    if not cfg.tie_word_embeddings:
        total += V * C
    return total


def free_memory_bytes(device: str | torch.device = "cpu") -> int | None:
    """Free memory on a device in bytes (None if unknown).

    CUDA: ``torch.cuda.mem_get_info`` (free bytes the driver reports); CPU: the
    operating system's available memory (psutil); MPS: the recommended working set
    minus what torch has allocated.
    """
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        if dev.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


@dataclass(frozen=True)
class MemoryPlan:
    """A memory plan. Bytes are bytes, contexts are tokens.

    Attributes:
        layers, kv_heads, head_dim: the model's shape.
        cache_dtype: the KV cache's dtype name.
        kv_bytes_per_token: 2 x layers x KV heads x head dim x element bytes.
        context: the context asked about (tokens).
        kv_bytes: KV bytes at ``context``.
        budget_bytes: the KV budget asked about (None if none).
        max_context_in_budget: whole tokens whose KV cache fits ``budget_bytes``
            (None without a budget; capped by nothing else).
        weights_bytes: the weights' bytes at ``weights_dtype`` (None without a model).
        weights_dtype: dtype of the weights in that figure.
        device: the device asked about; free_device_bytes its free memory (None if unknown).
        total_bytes: weights + KV at ``context`` (None without a model).
        fits_device: whether total (or KV alone) fits the free memory (None if unknown).
    """

    layers: int
    kv_heads: int
    head_dim: int
    cache_dtype: str
    kv_bytes_per_token: int
    context: int
    kv_bytes: int
    budget_bytes: int | None = None
    max_context_in_budget: int | None = None
    weights_bytes: int | None = None
    weights_dtype: str | None = None
    parameters: int | None = None
    device: str = "cpu"
    free_device_bytes: int | None = None
    total_bytes: int | None = None
    fits_device: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    cache_dtype: str | torch.dtype = "float32",
    context: int,
    budget_bytes: int | None = None,
    config: ModelConfig | None = None,
    weights_dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> MemoryPlan:
    """Plan the memory of a model at a context length.

    Args:
        layers, kv_heads, head_dim: the model's shape (from ``config`` when given).
        cache_dtype: KV-cache dtype name.
        context: context length in tokens (> 0).
        budget_bytes: optional KV budget in bytes: reports the longest context that fits.
        config: a model config: adds weights bytes and parameters.
        weights_dtype: weights' dtype for that figure (default: ``device``'s default,
            :func:`runtime.device.default_dtype`; float16 on the CPU).
        device: whose free memory to report.

    Raises:
        ValueError: non-positive numbers, an unknown dtype.
    """
    if context <= 0:
        raise ValueError(f"the context must be a positive number of tokens; got {context}")
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"the budget must not be negative; got {budget_bytes} bytes")
    eb = element_bytes(cache_dtype)
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, eb)
    kv = per_token * context
    params = weights = wdtype = None
    if config is not None:
        params = count_parameters(config)
        if weights_dtype is None:
            weights_dtype = default_dtype(torch.device(device))
        try:
            wdtype = dtype_name(parse_cache_dtype(weights_dtype))
        except ValueError:
            raise ValueError(f"unknown weights dtype {weights_dtype!r}; use float32, bfloat16 or float16") from None
        weights = params * element_bytes(wdtype)
    free = free_memory_bytes(device)
    total = (weights or 0) + kv
    return MemoryPlan(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        cache_dtype=dtype_name(parse_cache_dtype(cache_dtype)), kv_bytes_per_token=per_token,
        context=context, kv_bytes=kv, budget_bytes=budget_bytes,
        max_context_in_budget=None if budget_bytes is None else budget_bytes // per_token,
        weights_bytes=weights, weights_dtype=wdtype, parameters=params, device=str(torch.device(device)),
        free_device_bytes=free, total_bytes=total if config is not None else None,
        fits_device=None if free is None else total <= free,
    )


def plan_for_config(config: ModelConfig, **kwargs) -> MemoryPlan:
    """:func:`plan` with the shape taken from ``config``."""
    return plan(layers=config.n_layers, kv_heads=config.n_kv_heads, head_dim=config.head_dim, config=config, **kwargs)
