"""The memory planner: weights bytes, KV-cache bytes per token and at a context, what fits a budget.

Must not import Qt. Works from a loaded model's config or from bare numbers, so a user
can check a bigger model before fetching it.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element
(the cache stores one key and one value vector per KV head per layer per token); an
int8 cache adds one float32 scale per vector (:func:`runtime.dtypes.cache_number_bytes`),
passed to the functions below as ``scale_bytes``. The formula is written once, in
:mod:`models.kv_bytes`; the cache counts its own bytes with it too.

With sliding-window layers (Mistral, Gemma 2/3, Phi-3) a layer holds at most its window,
so the KV cache at a context of ``n`` tokens is, per layer,
``min(n, window) x 2 x KV heads x head dim x bytes`` (the same count
:meth:`runtime.cache.kv_cache.KVCache.bytes_at` makes), and the planner reports it per layer
type. Under a cache policy (:mod:`runtime.cache.policies`) a full layer holds at most the
policy's budget (a ceiling the cache never passes, :meth:`runtime.cache.policies.evictor.Evictor.within`),
so its tokens at ``n`` are ``min(n, budget)``, as a window's are. It also compares, for the model's shape, what multi-head (one KV head per query
head), grouped-query (the model's), multi-query (one KV head, Shazeer 2019, "Fast
Transformer Decoding: One Write-Head is All You Need") and sliding-window attention would
cost.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from models.kv_bytes import bytes_at, longest_context, policy_tokens
from runtime import device as devices
from runtime.config.model import ModelConfig
from runtime.device import compute_dtype, default_cache_dtype, profile_of
from runtime.dtypes import cache_number_bytes, dtype_name, parse_cache_dtype, parse_weight_dtype
from runtime.memory.sizes import attention_variants, cache_bytes_per_token, layer_type_figures


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
        per_layer += (2 * D if cfg.qk_norm else 0) + (2 * C if cfg.sandwich_norms else 0)  # Qwen3/Gemma extra norms
        total = V * C + L * per_layer + C
    else:
        per_layer += 2 * C * I + (I + C if cfg.mlp_bias else 0) + 4 * C
        total = V * C + cfg.max_position_embeddings * C + L * per_layer + 2 * C
    if not cfg.tie_word_embeddings:
        total += V * C
    return total


def _matrix_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, rows) of the decoder's token embedding (and an untied head) and every projection."""
    C, L, I = cfg.hidden_size, cfg.n_layers, cfg.intermediate_size
    qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    up_rows = 2 * I if cfg.family == "llama" else I
    heads = 1 if cfg.tie_word_embeddings else 2
    rows = cfg.vocab_size * heads + L * (qkv_out + C + up_rows + C)
    params = cfg.vocab_size * C * heads + L * (C * qkv_out + cfg.n_heads * cfg.head_dim * C + C * up_rows + I * C)
    return params, rows


def weights_bytes(cfg: ModelConfig, weights_dtype: str | torch.dtype, compute: str | torch.dtype | None = None) -> int:
    """Bytes of the weights of a decoder described by ``cfg`` stored in ``weights_dtype`` as the
    loader keeps them: matrices at the weight dtype's bytes (int8: a float32 scale per row
    of the embeddings and every projection, :func:`runtime.weights.convert.quantize_state`),
    norm weights and biases in the compute dtype (``compute``; default the CPU's:
    :func:`runtime.device.compute_dtype`, float32 for 16-bit weights, not 2 bytes each).

    Raises:
        ValueError: an unknown dtype.
    """
    dtype = parse_weight_dtype(weights_dtype)
    cdtype = parse_cache_dtype(compute) if compute is not None else compute_dtype(torch.device("cpu"), dtype)
    params = count_parameters(cfg)
    matrix_params, matrix_rows = _matrix_shape(cfg)
    positions = cfg.max_position_embeddings * cfg.hidden_size if cfg.family != "llama" else 0  # GPT-2's table
    vectors = (params - matrix_params - positions) * cdtype.itemsize
    if dtype != torch.int8:
        return (matrix_params + positions) * dtype.itemsize + vectors
    return matrix_params + 4 * matrix_rows + 4 * positions + vectors  # int8 keeps the positions in float32


# ---- what the process holds beside weights and KV cache --------------------------------------------
#: Resident bytes a loaded tokenizer adds per vocabulary entry (its vocabulary, merges, scores and
#: added tokens, in Rust and Python). Measured with scripts/memory_stages.py (anonymous RSS
#: across ``load_model`` less the weights, which are a mapped file; Intel Xeon, torch 2.13):
#: Gemma 3 270M's 262,144 entries 324.6 MB (1,238 B each), SmolLM2's 49,152 entries 19.0 MB
#: (387 B each). The larger is used: an upper figure for vocabularies like SmolLM2's.
TOKENIZER_BYTES_PER_ENTRY = 1_240
#: Tokens the session prefills at a time (runtime.generate.events.GenerationSettings.prefill_chunk).
PREFILL_CHUNK = 256
#: What the planner's total leaves out, said beside it.
LEAVES_OUT = ("the Python interpreter with torch and transformers imported (~270 MiB RSS measured here)",
              "the desktop's Qt and its widgets", "memory the allocator keeps after a reply until it is trimmed",
              "the reproducible mode's packed copy of float16 weights (1.78x their bytes for the default model)",
              "other processes' memory")


def tokenizer_bytes(vocab_size: int) -> int:
    """Resident bytes a tokenizer of ``vocab_size`` entries adds, at most (:data:`TOKENIZER_BYTES_PER_ENTRY`)."""
    return TOKENIZER_BYTES_PER_ENTRY * vocab_size


def turn_bytes(cfg: ModelConfig, compute: str | torch.dtype = "float32", *, chunk: int = PREFILL_CHUNK) -> int:
    """Bytes a reply allocates at its peak beside the weights and the KV cache: one prefill
    chunk's activations in the ``compute`` dtype (per token the residual, the normed input and
    the attention's output (3 C), q/k/v ((H + 2 Hkv) D), the MLP's gate/up and activation
    (3 I)), the chunk's attention scores (H x chunk x chunk float32, the chunk attending to
    itself) and the vocabulary's float32 logits twice (the last token's, and the copy
    the session keeps)."""
    eb = parse_cache_dtype(compute).itemsize
    C, I = cfg.hidden_size, cfg.intermediate_size
    qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    per_token = 3 * C + qkv_out + 3 * I
    return chunk * per_token * eb + cfg.n_heads * chunk * chunk * 4 + 2 * cfg.vocab_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    """A memory plan. Bytes are bytes, contexts are tokens.

    Attributes:
        layers, kv_heads, head_dim: the model's shape.
        cache_dtype: the KV cache's dtype name.
        kv_bytes_per_token: :func:`cache_bytes_per_token` (2 x layers x KV heads x head
            dim x element bytes, plus a 4-byte scale per vector for int8).
        context: the context asked about (tokens).
        kv_bytes: KV bytes at ``context``.
        budget_bytes: the KV budget asked about (None if none).
        max_context_in_budget: whole tokens whose KV cache fits ``budget_bytes``
            (None without a budget; capped by nothing else; :data:`models.kv_bytes.UNBOUNDED`
            when no layer grows past it: sliding windows or a cache policy bound them all).
        cache_budget: tokens a cache policy keeps per full-attention layer (None: no policy);
            ``kv_bytes`` and ``layer_types`` count full layers at ``min(context, cache_budget)``.
        weights_bytes: the weights' bytes at ``weights_dtype`` (None without a model), norm
            weights and biases at the compute dtype as the loader keeps them.
        weights_dtype: dtype of the weights in that figure.
        device: the device asked about; free_device_bytes its free memory (None if unknown).
        tokenizer_bytes: what the loaded tokenizer holds (:func:`tokenizer_bytes`; None without a model).
        turn_bytes: what a reply allocates at its peak beside weights and cache
            (:func:`turn_bytes`; None without a model).
        total_bytes: weights + KV at ``context`` + tokenizer + a reply's peak (None without a
            model); :data:`LEAVES_OUT` says what it leaves out (``leaves_out``).
        fits_device: whether total (or KV alone) fits the free memory (None if unknown).
        layer_types: per kind of layer (full, each window): ``kind``, ``window``,
            ``layers``, ``bytes_per_token`` (those layers together), ``tokens`` (each
            holds at ``context``) and ``used_bytes``, as the KV cache counts them.
        variants: for the model's shape, ``name`` (``multi-head``, ``grouped-query``,
            ``multi-query``, ``sliding-window``), ``kv_heads``, ``window``,
            ``bytes_per_token`` (before any window fills), ``bytes_at_context``, and
            ``this_model`` (the variant this model is). Multi-head needs the query
            heads: only with a model config.
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
    cache_budget: int | None = None
    weights_bytes: int | None = None
    weights_dtype: str | None = None
    parameters: int | None = None
    device: str = "cpu"
    free_device_bytes: int | None = None
    total_bytes: int | None = None
    fits_device: bool | None = None
    tokenizer_bytes: int | None = None
    turn_bytes: int | None = None
    leaves_out: tuple[str, ...] = LEAVES_OUT
    layer_types: list[dict] = field(default_factory=list)
    variants: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    cache_dtype: str | torch.dtype | None = None,
    context: int,
    budget_bytes: int | None = None,
    config: ModelConfig | None = None,
    weights_dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    windows: Sequence[int | None] | None = None,
    n_heads: int | None = None,
    blocks: tuple[int, str] | None = None,
    cache_budget: int | None = None,
    cache_budget_bytes: int | None = None,
) -> MemoryPlan:
    """Plan the memory of a model at a context length.

    Args:
        layers, kv_heads, head_dim: the model's shape (from ``config`` when given).
        cache_dtype: KV-cache dtype name (default: what the cache takes on ``device`` with
            those weights, :func:`runtime.device.default_cache_dtype`: float16 for a GGUF's
            blocks on the CPU, else the compute dtype: float32 on the CPU, float16 on CUDA and
            MPS for their default float16 weights).
        context: context length in tokens (> 0).
        budget_bytes: optional KV budget in bytes: reports the longest context that fits.
        config: a model config: adds weights bytes and parameters.
        weights_dtype: weights' dtype for that figure (default: ``device``'s default,
            :func:`runtime.device.default_dtype`; float16 on the CPU).
        device: the device planned for (its defaults) and whose free memory to report
            (none for a device this machine does not have).
        windows: per layer its sliding window in tokens or None (from ``config`` when
            given); default every layer full.
        n_heads: query heads per layer (from ``config`` when given): adds the
            multi-head row to :attr:`MemoryPlan.variants`.
        blocks: for a GGUF run from its own quantized blocks (the default for one),
            ``(bytes, name)``: its weights' bytes and its quantization (``"Q4_K_M"``),
            used when ``weights_dtype`` is not given (it computes as float16 weights do).
        cache_budget, cache_budget_bytes: a cache policy's budget, in tokens per full layer or
            in bytes of the whole cache (sliding layers at their whole window,
            :func:`models.kv_bytes.policy_tokens`); with both, the smaller. None: no policy.

    Raises:
        ValueError: non-positive numbers, an unknown dtype, a window list of the wrong length,
            a policy budget below one token.
    """
    if context <= 0:
        raise ValueError(f"the context must be a positive number of tokens; got {context}")
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"the budget must not be negative; got {budget_bytes} bytes")
    as_blocks = blocks is not None and weights_dtype is None
    if cache_dtype is None and as_blocks:
        cache_dtype = default_cache_dtype(device, torch.float16, blocks=True)
    elif cache_dtype is None:
        profile = profile_of(device)
        try:
            cache_dtype = profile.compute_dtypes[profile.weight_dtype if weights_dtype is None
                                                 else parse_weight_dtype(weights_dtype)]
        except ValueError:
            raise ValueError(f"unknown weights dtype {weights_dtype!r}; use float32, bfloat16, float16 or int8") from None
    dt = parse_cache_dtype(cache_dtype)
    eb, sb = cache_number_bytes(dt)
    per_token = cache_bytes_per_token(layers, kv_heads, head_dim, dt)
    if windows is None and config is not None:
        windows = config.windows
    windows = tuple(windows) if windows else (None,) * layers
    if len(windows) != layers or any(w is not None and w < 1 for w in windows):
        raise ValueError(f"give {layers} windows (a positive number of tokens or None); got {windows}")
    policy = _policy_budget(windows, kv_heads, head_dim, eb, sb, cache_budget, cache_budget_bytes)
    # A full layer under a policy holds what a window of its budget would.
    held = windows if policy is None else tuple(policy if w is None else w for w in windows)
    kv = bytes_at(held, kv_heads, head_dim, eb, context, sb)
    params = weights = wdtype = tok = turn = None
    if config is not None and as_blocks:  # the file's tensors as stored (norms included), computing as float16 weights do
        params, (weights, wdtype) = count_parameters(config), blocks
        tok, turn = tokenizer_bytes(config.vocab_size), turn_bytes(config, profile_of(device).compute_dtypes[torch.float16])
    elif config is not None:
        params = count_parameters(config)
        if weights_dtype is None:
            weights_dtype = profile_of(device).weight_dtype
        try:
            wdtype = dtype_name(parse_weight_dtype(weights_dtype))
        except ValueError:
            raise ValueError(f"unknown weights dtype {weights_dtype!r}; use float32, bfloat16, float16 or int8") from None
        cdtype = profile_of(device).compute_dtypes[parse_weight_dtype(wdtype)]
        weights = weights_bytes(config, wdtype, cdtype)
        tok, turn = tokenizer_bytes(config.vocab_size), turn_bytes(config, cdtype)
    free = devices.free_memory_bytes(device)
    total = (weights or 0) + kv + (tok or 0) + (turn or 0)
    return MemoryPlan(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        cache_dtype=dtype_name(parse_cache_dtype(cache_dtype)), kv_bytes_per_token=per_token,
        context=context, kv_bytes=kv, budget_bytes=budget_bytes, cache_budget=policy,
        max_context_in_budget=None if budget_bytes is None else longest_context(held, kv_heads, head_dim, eb, budget_bytes, sb),
        weights_bytes=weights, weights_dtype=wdtype, parameters=params, device=str(torch.device(device)),
        free_device_bytes=free, total_bytes=total if config is not None else None,
        fits_device=None if free is None else total <= free, tokenizer_bytes=tok, turn_bytes=turn,
        layer_types=layer_type_figures(windows, kv_heads, head_dim, eb, context, sb, policy=policy),
        variants=attention_variants(windows, kv_heads, head_dim, eb, context,
                                    n_heads=config.n_heads if config is not None else n_heads, scale_bytes=sb),
    )


def _policy_budget(windows, kv_heads: int, head_dim: int, eb: int, sb: int, tokens: int | None,
                   nbytes: int | None) -> int | None:
    """Tokens a cache policy keeps per full layer: the smaller of ``tokens`` and what ``nbytes``
    holds (None: no policy). Raises ValueError below one token."""
    budgets = [] if tokens is None else [int(tokens)]
    if nbytes is not None:
        budgets.append(policy_tokens(windows, kv_heads, head_dim, eb, nbytes, sb))
    if budgets and min(budgets) < 1:
        raise ValueError("a cache policy's budget must hold at least one token per layer; raise the budget")
    return min(budgets) if budgets else None


#: A model whose weights and KV cache take more than this share of the free memory is
#: "tight": the rest is what the app, the activations and everything else running need.
TIGHT_SHARE = 0.8


@dataclass(frozen=True)
class Fit:
    """Whether a model file fits this machine: weights at the file's size (quantized blocks
    stay as stored, DESIGN.md) plus the KV cache at ``context`` tokens, against free memory.

    Attributes:
        verdict: ``"fits"`` (at most :data:`TIGHT_SHARE` of the free memory), ``"tight"``
            (more, but within it), ``"does not fit"``, or ``"unknown"`` (free memory unknown).
        weights_bytes, kv_bytes, total_bytes, free_bytes: bytes (free None when unknown).
        context: tokens; device, cache_dtype: as planned.
        kv_bytes_per_token: the cache's bytes per token before any sliding window fills
            (:attr:`MemoryPlan.kv_bytes_per_token`), what a card quotes beside ``kv_bytes``.
    """

    verdict: str
    weights_bytes: int
    kv_bytes: int
    total_bytes: int
    free_bytes: int | None
    context: int
    device: str
    cache_dtype: str
    kv_bytes_per_token: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit(file_bytes: int, *, layers: int, kv_heads: int, head_dim: int, context: int,
        windows: Sequence[int | None] | None = None, device: str | torch.device = "cpu",
        cache_dtype: str | torch.dtype | None = None, free_bytes: int | None = None,
        blocks: bool = False, weights_dtype: str | torch.dtype | None = None) -> Fit:
    """:class:`Fit` of a model file of ``file_bytes`` with that shape at ``context`` tokens on
    ``device`` (its free memory from :func:`runtime.device.free_memory_bytes` unless ``free_bytes`` is given).

    ``blocks``: the file runs from its own quantized blocks, so its cache is planned in the
    dtype the loader gives that run (:func:`runtime.device.default_cache_dtype`: float16 on
    the CPU); else in the compute dtype of ``weights_dtype`` (default: the device's weights),
    float32 on the CPU. Which files run from their blocks is the loader's rule, not this
    module's: :func:`runtime.loader.support.fit` decides it from a file's block type.

    Raises:
        ValueError: as :func:`plan`.
    """
    p = plan(layers=layers, kv_heads=kv_heads, head_dim=head_dim, context=context, windows=windows,
             device=device, cache_dtype=cache_dtype, weights_dtype=None if blocks else weights_dtype,
             blocks=(file_bytes, "") if blocks else None)
    free = p.free_device_bytes if free_bytes is None else free_bytes
    total = file_bytes + p.kv_bytes
    if free is None:
        verdict = "unknown"
    else:
        verdict = "fits" if total <= TIGHT_SHARE * free else "tight" if total <= free else "does not fit"
    return Fit(verdict, file_bytes, p.kv_bytes, total, free, context, p.device, p.cache_dtype, p.kv_bytes_per_token)


def plan_for_config(config: ModelConfig, **kwargs) -> MemoryPlan:
    """:func:`plan` with the shape taken from ``config``."""
    return plan(layers=config.n_layers, kv_heads=config.n_kv_heads, head_dim=config.head_dim, config=config, **kwargs)


