"""The decoder: Llama family (Llama, SmolLM, Mistral, Qwen2/3, Phi-3, Gemma 2/3) and GPT-2, top to bottom.

Must not import Qt. Pre-norm blocks, ``Block.forward`` is two residual lines. RoPE and
its variants are :mod:`runtime.rope` (tables built once per variant, grown as positions
need them). Attention is ``runtime.attention``; the KV cache is
``runtime.kv_cache.KVCache``.

Family pieces, each chosen by :class:`runtime.config.ModelConfig`: sliding-window
layers (Mistral, Phi-3, Gemma), RMSNorm over each query/key head (Qwen3, Gemma 3),
Gemma's ``(1 + w)`` RMSNorm, ``sqrt(hidden)`` embedding scale, GeGLU, norms after
attention and MLP ("sandwich"), ``query_pre_attn_scalar`` and soft-capping (Gemma 2),
separate RoPE bases for local and global layers (Gemma 3).

Fused projections: q/k/v are one matrix and so are the MLP's gate/up. One GEMV
instead of three (or two) per layer saves dispatch time on the decode path, where
each token is one matrix-vector product per weight.

Matrix products on the CPU go through oneDNN (:func:`linear`): for one token, the
float32 matrix-vector product that ``F.linear`` hands to MKL reads weights at about
10 GB/s on our 2-core benchmark machine, oneDNN's at about 24 GB/s (measured on the
49152 x 576 LM head), and decode reads every weight once per token.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import kernels as kernel_lib
from runtime.attention import DEFAULT_KERNELS, AttentionKernels, attention
from runtime.config import ModelConfig
from runtime.kernels import KernelChoice, WeightRef
from runtime.kv_cache import KVCache
from runtime.rope import RopeSpec, apply_rope, rope_tables, rotate_half, rotation_by

__all__ = ["Decoder", "Linear", "linear", "apply_rope", "rotate_half"]

#: Called per layer with attention weights ``(B, H, Tq, Tk)`` when set (probe only); an
#: observer with a true ``last_row_only`` attribute gets the newest query's row only,
#: ``(B, H, 1, Tk)``, and attention keeps its fast path.
AttentionObserver = Callable[[int, torch.Tensor], None]


def _probe_onednn_linear(dtype: torch.dtype = torch.float32):
    """``torch.ops.mkldnn._linear_pointwise`` when this torch build has it and it computes
    a known product right in ``dtype`` on this CPU, else None.

    Per dtype: oneDNN builds without a bfloat16 inner product for some CPUs ("could not
    create a primitive descriptor", seen on an AMD EPYC Zen 3 with AVX2 and no AVX-512) while
    float32 works.
    """
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        op = torch.ops.mkldnn._linear_pointwise
        with torch.inference_mode():
            out = op(torch.ones(1, 2, dtype=dtype), torch.ones(3, 2, dtype=dtype), None, "none", [None], "")
        return op if torch.equal(out.float(), torch.full((1, 3), 2.0)) else None
    except (AttributeError, RuntimeError):
        return None


#: oneDNN's linear op per dtype (None where it does not work); probed on first use
#: (nothing runs at import).
_ONEDNN_LINEAR: dict[torch.dtype, object] = {}


def _onednn_linear_op(dtype: torch.dtype = torch.float32):
    """The op for ``dtype`` (probed once, on first use) or None."""
    if dtype not in _ONEDNN_LINEAR:
        _ONEDNN_LINEAR[dtype] = _probe_onednn_linear(dtype)
    return _ONEDNN_LINEAR[dtype]


_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


#: Whether ``torch.ops.attnchat.onednn_linear`` is defined (by :func:`probe_linear_kernels`).
_COMPILED_ONEDNN = False


def probe_linear_kernels() -> None:
    """Probe oneDNN's linear op now, and when it works define ``attnchat::onednn_linear``
    (float32 ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``) for compiled code.

    Call before ``torch.compile`` traces :func:`linear`, which cannot probe while tracing.
    Inductor lowers oneDNN's own op only for weights frozen into the graph (a packed
    copy of every weight), so the compiled step calls it through this opaque op instead.
    """
    global _COMPILED_ONEDNN
    for dtype in _ONEDNN_DTYPES:
        _onednn_linear_op(dtype)
    if _COMPILED_ONEDNN or _ONEDNN_LINEAR.get(torch.float32) is None:
        return
    op = _ONEDNN_LINEAR[torch.float32]

    @torch.library.custom_op("attnchat::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return op(x, weight, None, "none", [None], "")

    @onednn_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    _COMPILED_ONEDNN = True


def _rounded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded to the 16-bit ``weight``'s dtype, a 16-bit product (float32
    accumulation inside the kernel), the result back in float32."""
    out = F.linear(x.to(weight.dtype), weight).to(torch.float32)
    return out if bias is None else out + bias


#: The matrix-product paths of :func:`linear`, one per kind of device (chosen by
#: :func:`runtime.device.linear_path`; any of them runs on the CPU when passed explicitly).
LINEAR_PATHS = ("cpu", "accelerator")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, path: str = "cpu"
) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``: ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``
    in ``x``'s dtype.

    ``path`` (:data:`LINEAR_PATHS`, chosen per device by :func:`runtime.device.linear_path`):

    - ``"cpu"``, ``x`` and ``weight`` both float32 or both bfloat16: oneDNN's inner product
      (the kernel PyTorch's own compiler uses for CPU linear layers), which keeps both
      cores busy on a single token (where this CPU's oneDNN has it for the dtype).
    - float32 ``x`` with 16-bit (float16 or bfloat16) ``weight``: 16-bit weights
      computing in float32 (see :func:`runtime.device.compute_dtype`). On the
      ``"accelerator"`` path, and for one token on the ``"cpu"`` path, ``x`` is rounded to the weight's dtype for a 16-bit product
      (tensor cores; on the CPU torch's float16 matrix-vector kernel reads weights at
      about 25 GB/s); on the ``"cpu"`` path more tokens widen the weight to float32 in a scratch
      buffer, a big matrix a block of rows at a time (:func:`runtime.kernels.widened_product`),
      so prefill keeps float32 arithmetic.
    - Inside ``torch.compile``: float32 on the ``"cpu"`` path through oneDNN as above when
      :func:`probe_linear_kernels` found it (inductor's own choice for an unfrozen
      weight is MKL's GEMV, which read the default model's weights at 11 GB/s against
      oneDNN's 17 on an AMD EPYC Zen 3, 2 cores); 16-bit weights as above; else ``F.linear``.
    - Anything else and anything that needs gradients: ``F.linear``.
    """
    sixteen = x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16)
    if torch.compiler.is_compiling():
        if sixteen:
            return _rounded(x, weight, bias)
        if _COMPILED_ONEDNN and path == "cpu" and x.dtype == weight.dtype == torch.float32:
            # an opaque op to inductor: it calls oneDNN's inner product as is
            out = torch.ops.attnchat.onednn_linear(x, weight)
            return out if bias is None else out + bias
        return F.linear(x, weight.to(x.dtype), bias)
    if path == "cpu" and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        if sixteen:
            if x.numel() == x.shape[-1]:  # one token
                return _rounded(x, weight, bias)
            # float32 in the kernels' scratch buffer, a big matrix in blocks of rows
            return kernel_lib.widened_product(_cpu_product, x, weight, None, bias)
        return _cpu_product(x, weight, bias)
    elif sixteen and not torch.is_grad_enabled():
        return _rounded(x, weight, bias)
    return F.linear(x, weight.to(x.dtype), bias)


def _cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product when ``x`` and ``weight`` share a dtype it runs here, else ``F.linear``."""
    if x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype:
        op = _ONEDNN_LINEAR[x.dtype] if x.dtype in _ONEDNN_LINEAR else _onednn_linear_op(x.dtype)
        if op is not None:
            return op(x, weight, bias, "none", [None], "")
    return F.linear(x, weight.to(x.dtype), bias)


def _kernel_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product goes through the measured CPU kernels (set only on a CPU model, see
    :meth:`Decoder.set_kernels`): float32 activations (what they were timed for), never
    with gradients, nor inside ``torch.compile``, where inductor picks its own."""
    return (x.dtype == torch.float32 and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def _weight_ref(module: nn.Module) -> WeightRef:
    """A module's matrix (and int8 row scales, if any) for :mod:`runtime.kernels`."""
    return WeightRef(module.weight, getattr(module, "weight_scale", None))


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 codes ``(out, in)`` times per-row ``scale (out,)``, as ``dtype`` (any device)."""
    return (weight.to(torch.float32) * scale.unsqueeze(1)).to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear`, or the measured CPU kernels
    (:mod:`runtime.kernels`) once :meth:`Decoder.set_kernels` chose them; no random init
    (see :class:`Embedding`). int8 weights carry per-row scales in ``weight_scale (out,)``."""

    kernels: KernelChoice | None = None
    weight_ref: WeightRef | None = None
    path: str = "cpu"  # :data:`LINEAR_PATHS`, set by Decoder.set_linear_path

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and _kernel_path(x, self.weight):
            return kernel_lib.apply(self.kernels, x, self.weight_ref, self.bias)
        if self.kernels is not None and self.kernels.decode == "mkl" and torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)  # the measured choice, also compiled
        scale = getattr(self, "weight_scale", None)
        weight = self.weight if scale is None else _dequantized(self.weight, scale, x.dtype)
        return linear(x, weight, self.bias, path=self.path)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without the random init: the decoder's weights always come from
    :meth:`Decoder.load_weights`, and initializing on the meta device imports torch's
    meta kernels (1.4 s of a 3 s start on our 2-core machine). int8 rows carry a scale
    each in ``weight_scale (V,)``: a lookup returns ``codes * scale`` in float32."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        scale = getattr(self, "weight_scale", None)
        return out if scale is None else out.to(torch.float32) * scale[ids].unsqueeze(-1)


#: RoPE tables grow in steps of this many positions (not the whole context at once:
#: Gemma 3's 32k x 256 float32 tables would take 64 MiB per variant).
_ROPE_STEP = 4096


class Attention(nn.Module):
    """Multi-head / grouped-query / multi-query self-attention with a fused q/k/v projection,
    full or sliding-window."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.scale = cfg.attn_scale or None
        self.softcap = cfg.attn_softcap or None
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        # Edits the heads' outputs (B, H, T, D) before o_proj: runtime.ablation sets it while
        # heads are knocked out; None (one attribute check per layer) otherwise.
        self.head_edit: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.kernels: AttentionKernels = DEFAULT_KERNELS  # set by Decoder.set_attention_kernels
        self.q_norm = Norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = Norm(cfg, cfg.head_dim) if cfg.qk_norm else None

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, H, T, D)``, keys and values ``(B, Hkv, T, D)`` of the normed input
        ``x (B, T, C)``: q/k head norms when the family has them, then RoPE when ``rope``
        (cos, sin tables ``(T, R)``) is given."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hkv) D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # RMSNorm over each head's D channels
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        layer: int,
        observer: AttentionObserver | None = None,
        pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q, k, v = self.project(x, rope)
        first = 0  # position of the first key
        kw = dict(scale=self.scale, window=self.window, softcap=self.softcap)
        if pos is not None:
            # The static decode step: write at a tensor position, attend over the whole
            # fixed-capacity buffer with ``mask`` hiding the slots past the position.
            k, v = cache.write_at(layer, pos, k, v)  # (B, Hkv, capacity, D)
            y = attention(q, k, v, causal=False, mask=mask, kernels=self.kernels, scale=self.scale, softcap=self.softcap)
        else:
            if cache is not None:
                first = cache.start[layer]
                k, v = cache.update(layer, k, v)  # (B, Hkv, Tcached + T, D); a sliding layer holds its window
            if observer is not None and getattr(observer, "last_row_only", False):
                # Only the newest query's weights are wanted (the live view): the fast path
                # for the output, the formula for one row (it sees every key: no mask).
                y = attention(q, k, v, causal=True, kernels=self.kernels, **kw)
                _, weights = attention(q[:, :, -1:], k, v, causal=True, return_weights=True, **kw)  # (B, H, 1, Tk)
                observer(layer, F.pad(weights, (first, 0)))
            elif observer is not None:
                y, weights = attention(q, k, v, causal=True, return_weights=True, **kw)
                observer(layer, F.pad(weights, (first, 0)))  # keys a sliding layer dropped: weight 0
            else:
                y = attention(q, k, v, causal=True, kernels=self.kernels, **kw)  # (B, H, T, D)
        if self.head_edit is not None:
            y = self.head_edit(layer, y)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H D)
        return self.o_proj(y)


class MLP(nn.Module):
    """Gated (llama family: ``down(act(gate(x)) * up(x))``, SiLU = SwiGLU, tanh-GELU = Gemma's
    GeGLU) or GELU (GPT-2: ``proj(gelu(fc(x)))``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.family == "llama"
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, (2 if self.gated else 1) * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.activation == "silu":
            self.act = F.silu
        else:  # gelu_pytorch_tanh, gelu_new: the tanh approximation; gelu: exact
            approx = "none" if cfg.activation == "gelu" else "tanh"
            self.act = lambda t: F.gelu(t, approximate=approx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.gated:
            gate, up = h.split(self.intermediate, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(h))


class Norm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) for the llama family, LayerNorm for GPT-2.

    Gemma's RMSNorm multiplies by ``1 + w``: :meth:`Decoder.load_weights` folds the
    offset into the weight once (``weight`` then holds ``1 + w``).
    """

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        dim = dim or cfg.hidden_size
        self.rms = cfg.family == "llama"
        self.eps = cfg.norm_eps
        self.offset = cfg.norm_offset
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Block(nn.Module):
    """Pre-norm decoder block; Gemma adds a norm after attention and after the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = Norm(cfg)
        self.mlp = MLP(cfg)
        self.post_attn_norm = Norm(cfg) if cfg.sandwich_norms else nn.Identity()
        self.post_mlp_norm = Norm(cfg) if cfg.sandwich_norms else nn.Identity()

    def forward(self, x, rope, cache, layer, observer=None, pos=None, mask=None):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope, cache, layer, observer, pos, mask))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Decoder(nn.Module):
    """Token ids -> logits, with an optional KV cache.

    Build on the meta device, then :meth:`load_weights` assigns real tensors
    (no second copy). Nothing is randomly initialized: built on a real device, the
    weights are uninitialized memory until loaded.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = Norm(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        #: Per layer, its RoPE variant (None for GPT-2).
        self.layer_ropes: list[RopeSpec | None] = [
            cfg.layer_rope(i) if cfg.family == "llama" else None for i in range(cfg.n_layers)
        ]
        # Keyed by the spec's repr, made here once: torch.compile guards on this dict's keys
        # and takes only literal keys (a RopeSpec key made the compiled step fail when the
        # eager path had filled the dict first), and cannot trace a dataclass's repr.
        self._rope_keys = [repr(spec) for spec in self.layer_ropes]
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.observer: AttentionObserver | None = None
        self.compute_dtype: torch.dtype = torch.float32
        self.kernels: KernelChoice | None = None
        self.linear_path = "cpu"  # see set_linear_path
        self._head_ref: WeightRef | None = None

    def load_weights(self, state: dict[str, torch.Tensor], compute_dtype: torch.dtype | None = None) -> None:
        """Assign tensors named as in :func:`runtime.weights.to_decoder_state` (strict).

        Args:
            state: the weights; matrices (embeddings, projections) keep their dtype.
                int8 matrices come with ``<name>.weight_scale`` ``(out,)`` float32 entries
                (:func:`runtime.weights.quantize_state`).
            compute_dtype: the activations' dtype (default: the embedding's dtype). Norm
                weights (Gemma's with their ``1 +`` folded in), biases are cast to it;
                :func:`linear` bridges float16 matrices and float32 activations.
        """
        scales = {k.removesuffix(".weight_scale"): state[k] for k in state if k.endswith(".weight_scale")}
        if scales:
            self.requires_grad_(False)  # integer tensors cannot require gradients
        self.load_state_dict({k: v for k, v in state.items() if not k.endswith(".weight_scale")}, strict=True, assign=True)
        for name, scale in scales.items():
            self.get_submodule(name).register_buffer("weight_scale", scale, persistent=False)
        self.compute_dtype = compute_dtype or (torch.float32 if scales else self.embed.weight.dtype)
        for module in self.modules():
            for name in ("weight", "bias") if isinstance(module, Norm) else ("bias",) if isinstance(module, Linear) else ():
                p = getattr(module, name)
                if p is None:
                    continue
                data = p.data.float() + module.offset if isinstance(module, Norm) and name == "weight" and module.offset else p.data
                if data is not p.data or p.dtype != self.compute_dtype:
                    setattr(module, name, nn.Parameter(data.to(self.compute_dtype), requires_grad=p.requires_grad))
        self._rope_tables = {}

    def rope(self, layer: int, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin ``(T, R)`` in the compute dtype for layer ``layer``'s positions
        ``start .. start+T-1`` (None for GPT-2).

        Tables are built once per RoPE variant and grown in steps of 4,096 positions.
        A length-dependent variant past its trained context (longrope) takes the
        frequencies of the sequence so far, ``start + T``, as transformers does.
        """
        spec = self.layer_ropes[layer]
        if spec is None:
            return None
        end = start + T
        device = self.embed.weight.device
        if spec.type == "longrope" and end > spec.original_max_positions:
            cos, sin = rope_tables(spec, self.cfg.head_dim, start, end, seq_len=end)
            return cos.to(device, self.compute_dtype), sin.to(device, self.compute_dtype)
        key = self._rope_keys[layer]
        cos, sin = self._rope_tables.get(key, (None, None))
        if cos is None or cos.shape[0] < end:
            n = min(-(-end // _ROPE_STEP) * _ROPE_STEP, max(self.cfg.max_position_embeddings, end))
            # Normal tensors even when first built under inference mode: the gradient
            # views (runtime.explain) use the same tables under autograd.
            with torch.inference_mode(False):
                cos, sin = rope_tables(spec, self.cfg.head_dim, 0, n)
                cos, sin = cos.to(device, self.compute_dtype), sin.to(device, self.compute_dtype)
            self._rope_tables[key] = (cos, sin)
        return cos[start:end], sin[start:end]

    @property
    def rope_cos(self) -> torch.Tensor | None:
        """Layer 0's cos table ``(max_position_embeddings, R)`` (None for GPT-2)."""
        t = self.rope(0, 0, self.cfg.max_position_embeddings)
        return None if t is None else t[0]

    @property
    def rope_sin(self) -> torch.Tensor | None:
        """Layer 0's sin table ``(max_position_embeddings, R)`` (None for GPT-2)."""
        t = self.rope(0, 0, self.cfg.max_position_embeddings)
        return None if t is None else t[1]

    def set_kernels(self, choice: KernelChoice | None) -> None:
        """Run every CPU matrix product (projections and the LM head) with ``choice``'s
        kernels (:mod:`runtime.kernels`); None goes back to :func:`linear`."""
        self.kernels = choice
        for m in self.modules():
            if isinstance(m, Linear):
                m.kernels = choice
                m.weight_ref = None if choice is None else _weight_ref(m)
        self._head_ref = None if choice is None else _weight_ref(self._head())

    def _head(self) -> nn.Module:
        """The LM head's module (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    @staticmethod
    def _projections(block: Block) -> tuple[Linear, ...]:
        return block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj

    def token_matrices(self) -> list[WeightRef]:
        """Every matrix a decoded token passes through, in order (each layer's projections,
        then the LM head), for the decode timing of :func:`runtime.kernels.measure`."""
        return [_weight_ref(m) for block in self.blocks for m in self._projections(block)] + [_weight_ref(self._head())]

    def kernel_matrices(self) -> list[tuple[WeightRef, int]]:
        """One matrix of each of a block's projections (times the layers) and the LM head
        (once): what a token passes through, for :func:`runtime.kernels.measure`."""
        out = [(_weight_ref(m), self.cfg.n_layers) for m in self._projections(self.blocks[0])]
        return out + [(_weight_ref(self._head()), 1)]

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for ``input_ids (B, T)``.

        With a cache the tokens take positions ``cache.length ..``, attend to every
        cached token before them (a sliding layer: to its window), and are appended to
        the cache.

        Returns:
            float32 logits ``(B, T, V)``, or ``(B, 1, V)`` with ``last_only``.

        Raises:
            CacheLimitError: the cache cannot hold ``T`` more tokens.
            ValueError: positions past the model's maximum context.
        """
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_position_embeddings:
            raise ValueError(
                f"{start + T} tokens pass the model's maximum context of {self.cfg.max_position_embeddings}"
            )
        if cache is not None:
            cache.reserve(T)
        x = self.embed(input_ids).to(self.compute_dtype)  # (B, T, C)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[start : start + T].to(self.compute_dtype)
        ropes: dict[RopeSpec | None, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for i, block in enumerate(self.blocks):
            spec = self.layer_ropes[i]
            if spec not in ropes:
                ropes[spec] = self.rope(i, start, T)  # (T, R) each, one per variant
            x = block(x, ropes[spec], cache, i, self.observer)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        return self._logits(x)  # (B, T, V)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``(B, T, V)`` of final-normed ``x (B, T, C)``: the LM head (the
        measured CPU kernels when chosen, int8 rows times their scales), then Gemma's soft-cap."""
        head_module = self._head()
        if self.kernels is not None and _kernel_path(x, head_module.weight):
            logits = kernel_lib.apply(self.kernels, x, self._head_ref, None).float()
        else:
            head, scale = head_module.weight, getattr(head_module, "weight_scale", None)
            logits = linear(x, head if scale is None else _dequantized(head, scale, x.dtype), path=self.linear_path).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def set_linear_path(self, path: str) -> None:
        """Run every matrix product (projections and the LM head) on :func:`linear`'s
        ``path`` (:data:`LINEAR_PATHS`; per device: :func:`runtime.device.linear_path`).

        Raises:
            ValueError: an unknown path.
        """
        if path not in LINEAR_PATHS:
            raise ValueError(f"unknown linear path {path!r}; use one of {', '.join(LINEAR_PATHS)}")
        self.linear_path = path
        for m in self.modules():
            if isinstance(m, Linear):
                m.path = path

    def set_attention_kernels(self, kernels: AttentionKernels) -> None:
        """Use ``kernels`` (see :class:`runtime.attention.AttentionKernels`) in every layer."""
        for block in self.blocks:
            block.attn.kernels = kernels

    def decode_static(self, token: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step at fixed shapes (what :mod:`runtime.decode_step` captures or compiles).

        The same blocks as :meth:`forward`, but nothing depends on the position's value
        on the host: RoPE rows and learned positions are gathered at ``pos``, the new
        keys and values written there (``index_copy_``), and attention reads the cache's
        whole ``capacity`` with a mask row (key ``j`` visible iff ``j <= pos``). The
        caller reserves the slot before and advances the cache after.

        Args:
            token: ``(B, 1)`` int64 token ids, on the model's device.
            pos: ``(1,)`` int64, the new token's position (= ``cache.length``), on the device.
            cache: a cache with ``capacity > pos``; its buffers must hold finite values
                (they are zero-filled on allocation).

        Returns:
            float32 logits ``(B, 1, V)``.
        """
        x = self.embed(token).to(self.compute_dtype)  # (B, 1, C)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight.index_select(0, pos).to(self.compute_dtype)
        slots = torch.arange(cache.capacity, device=pos.device)
        mask = (slots <= pos).view(1, 1, 1, cache.capacity)  # (1, 1, 1, capacity)
        ropes: dict[RopeSpec | None, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for i, block in enumerate(self.blocks):
            spec = self.layer_ropes[i]
            if spec not in ropes:  # this variant's rows at ``pos``, (1, R) each
                table = self.rope(i, 0, self.cfg.max_position_embeddings)
                ropes[spec] = None if table is None else (table[0].index_select(0, pos), table[1].index_select(0, pos))
            x = block(x, ropes[spec], cache, i, None, pos, mask)
        return self._logits(self.final_norm(x))  # (B, 1, V)

    @torch.inference_mode()
    def shift_key_positions(self, cache: KVCache, start: int, end: int, delta: int) -> None:
        """Re-rotate cached keys at positions ``start .. end-1`` by ``delta`` positions (in place).

        RoPE rotations compose: ``R(p + delta) k = R(delta) R(p) k``, so moving keys
        that were rotated at position ``p`` to ``p + delta`` needs one rotation by
        ``delta`` (used after evicting the middle of the cache), each layer with its own
        variant. GPT-2's learned absolute positions are added to the embeddings, not the
        keys: nothing to do.
        """
        if start >= end or delta == 0:
            return
        for i in range(len(cache.k)):
            spec = self.layer_ropes[i]
            if spec is None:
                return
            c, s = rotation_by(spec, self.cfg.head_dim, delta)  # (R,)
            a, b = cache.slots(i, start, end)
            R = c.shape[0]

            def rotate(seg: torch.Tensor, c=c, s=s, R=R) -> torch.Tensor:  # (B, Hkv, n, D) float32
                out = seg.clone()
                out[..., :R] = seg[..., :R] * c + rotate_half(seg[..., :R]) * s
                return out

            cache.transform_keys(i, a, b, rotate)
