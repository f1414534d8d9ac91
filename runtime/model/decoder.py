"""The decoder: Llama family (Llama, SmolLM2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Granite 3, OLMo 2)
and GPT-2, top to bottom.

Must not import Qt. Pre-norm blocks, ``Block.forward`` is two residual lines. RoPE and
its variants are :mod:`runtime.model.rope` (tables built once per variant, grown as positions
need them). Attention, the function and the layer (:class:`runtime.model.attention.Attention`),
is :mod:`runtime.model.attention`; the KV cache is
``runtime.cache.kv_cache.KVCache``.

Family pieces, each chosen by :class:`runtime.config.model.ModelConfig`: sliding-window
layers (Mistral, Phi-3, Gemma), RMSNorm over each query/key head (Qwen3, Gemma 3),
Gemma's ``(1 + w)`` RMSNorm, ``sqrt(hidden)`` embedding scale, GeGLU, norms after
attention and MLP ("sandwich"), ``query_pre_attn_scalar`` and soft-capping (Gemma 2),
separate RoPE bases for local and global layers (Gemma 3), layers without RoPE (SmolLM3),
Granite's multipliers (embedding, attention scale, residual branches, logits), OLMo 2's norms
after attention and the MLP only, with q/k norms over the whole projection.

Fused projections: q/k/v are one matrix and so are the MLP's gate/up. One GEMV
instead of three (or two) per layer saves dispatch time on the decode path, where
each token is one matrix-vector product per weight.

Matrix products on the CPU go through oneDNN (:func:`runtime.model.layers.linear`): for one token, the
float32 matrix-vector product that ``F.linear`` hands to MKL reads weights at about
10 GB/s on our 2-core benchmark machine, oneDNN's at about 24 GB/s (measured on the
49152 x 576 LM head), and decode reads every weight once per token.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from runtime.cache.kv_cache import KVCache
from runtime.config.model import ModelConfig
from runtime.config.rope import RopeSpec
from runtime.device import DeviceProfile
from runtime.kernels.choice import KernelChoice
from runtime.kernels.choice import apply as apply_kernel
from runtime.kernels.cpu import WeightRef
from runtime.model.attention import Attention, AttentionKernels, AttentionObserver
from runtime.model.hooks import AttentionHooks
from runtime.model.layers import (
    LINEAR_PATHS,
    MLP,
    Embedding,
    Linear,
    Norm,
    Numerics,
    Scale,
    dequantized,
    kernel_path,
    linear,
    weight_ref,
)
from runtime.model.quant_layers import QuantEmbedding, QuantLinear
from runtime.model.rope import apply_rope, rope_tables, rotate_half, shift_cached_keys  # noqa: F401 (re-exported)

__all__ = ["Decoder", "Linear", "linear", "apply_rope", "rotate_half"]

#: RoPE tables grow in steps of this many positions (not the whole context at once:
#: Gemma 3's 32k x 256 float32 tables would take 64 MiB per variant).
_ROPE_STEP = 4096


class Block(nn.Module):
    """Pre-norm decoder block; Gemma adds a norm after attention and after the MLP, OLMo 2 has
    those only, Granite scales each branch's output (``post_*_norm`` is then a :class:`Scale`)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        if cfg.sandwich_norms and cfg.residual_scale != 1.0:
            raise ValueError("a residual multiplier with norms after attention and the MLP is not built")
        self.attn_norm = Norm(cfg) if cfg.pre_norms else nn.Identity()
        self.attn = Attention(cfg, layer)
        self.mlp_norm = Norm(cfg) if cfg.pre_norms else nn.Identity()
        self.mlp = MLP(cfg)
        post = (lambda: Norm(cfg)) if cfg.sandwich_norms else \
            (lambda: Scale(cfg.residual_scale)) if cfg.residual_scale != 1.0 else nn.Identity
        self.post_attn_norm = post()
        self.post_mlp_norm = post()

    def forward(self, x, rope, cache, layer, hooks=(), pos=None, mask=None):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope, cache, layer, hooks, pos, mask))
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
        #: Per layer, its RoPE variant (None: no RoPE, GPT-2's and SmolLM3's NoPE layers).
        self.layer_ropes: list[RopeSpec | None] = [
            cfg.layer_rope(i) if cfg.family == "llama" and i not in cfg.nope_layers else None
            for i in range(cfg.n_layers)
        ]
        # Keyed by the spec's repr, made here once: torch.compile guards on this dict's keys
        # and takes only literal keys (a RopeSpec key made the compiled step fail when the
        # eager path had filled the dict first), and cannot trace a dataclass's repr.
        self._rope_keys = [repr(spec) for spec in self.layer_ropes]
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: The attention hooks (:mod:`runtime.model.hooks`), one list shared by every layer.
        self.hooks = AttentionHooks()
        #: How every layer computes where the device profile decides (:meth:`use_profile`), one
        #: object shared by every layer as the hooks list is.
        self.numerics = Numerics()
        for block in self.blocks:
            block.attn.hooks = self.hooks
        for m in self.modules():
            if isinstance(m, (Attention, MLP, Linear)):
                m.numerics = self.numerics
        # longrope's frequencies depend on the sequence length past its trained context
        self._length_rope = any(spec is not None and spec.type == "longrope" for spec in self.layer_ropes)
        self.compute_dtype: torch.dtype = torch.float32
        self.kernels: KernelChoice | None = None
        #: The device profile it computes with (:meth:`use_profile`; None: not given one).
        self.profile: DeviceProfile | None = None
        self._head_ref: WeightRef | None = None

    def load_weights(self, state: dict[str, torch.Tensor], compute_dtype: torch.dtype | None = None) -> None:
        """Assign tensors named as in :func:`runtime.weights.convert.to_decoder_state` (strict).

        Args:
            state: the weights; matrices (embeddings, projections) keep their dtype.
                int8 matrices come with ``<name>.weight_scale`` ``(out,)`` float32 entries
                (:func:`runtime.weights.convert.quantize_state`).
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
        quantized = isinstance(self.embed, QuantEmbedding)
        self.compute_dtype = compute_dtype or (torch.float32 if scales or quantized else self.embed.weight.dtype)
        for module in self.modules():
            kind = Norm if isinstance(module, Norm) else Linear if isinstance(module, (Linear, QuantLinear)) else None
            for name in ("weight", "bias") if kind is Norm else ("bias",) if kind is Linear else ():
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
        device = self.final_norm.weight.device  # (a GGUF's QuantEmbedding has no .weight)
        if spec.type == "longrope" and end > spec.original_max_positions:
            cos, sin = rope_tables(spec, self.cfg.head_dim, start, end, seq_len=end)
            return cos.to(device, self.compute_dtype), sin.to(device, self.compute_dtype)
        key = self._rope_keys[layer]
        cos, sin = self._rope_tables.get(key, (None, None))
        if cos is None or cos.shape[0] < end:
            n = min(-(-end // _ROPE_STEP) * _ROPE_STEP, max(self.cfg.max_position_embeddings, end))
            # Normal tensors even when first built under inference mode: the gradient
            # views (runtime.insight.explain) use the same tables under autograd.
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
                m.weight_ref = None if choice is None else weight_ref(m)
        head = self._head()
        self._head_ref = (None if choice is None or isinstance(head, (QuantEmbedding, QuantLinear))
                          else head.weight_ref if isinstance(head, Linear) else weight_ref(head))

    def _head(self) -> nn.Module:
        """The LM head's module (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    @staticmethod
    def _projections(block: Block) -> tuple[Linear, ...]:
        return block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj

    def token_matrices(self) -> list[WeightRef]:
        """Every matrix a decoded token passes through, in order (each layer's projections,
        then the LM head), for the decode timing of :func:`runtime.kernels.choice.measure`."""
        return [weight_ref(m) for block in self.blocks for m in self._projections(block)] + [weight_ref(self._head())]

    def kernel_matrices(self) -> list[tuple[WeightRef, int]]:
        """One matrix of each of a block's projections (times the layers) and the LM head
        (once): what a token passes through, for :func:`runtime.kernels.choice.measure`."""
        out = [(weight_ref(m), self.cfg.n_layers) for m in self._projections(self.blocks[0])]
        return out + [(weight_ref(self._head()), 1)]

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        last_only: bool = False,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids (B, T)``: one forward for a prefill, an eager decode step and
        the static step (as gpt-fast's ``forward(idx, input_pos)``).

        Without ``input_pos``, with a cache the tokens take positions ``cache.length ..``, attend
        to every cached token before them (a sliding layer: to its window), and are appended
        to the cache (reserved before, advanced after).

        With ``input_pos`` (``(1,)`` int64 on the device, ``= cache.length``; ``T`` = 1): the
        static step that :mod:`runtime.model.decode_step` captures or compiles. Nothing depends
        on the position's value on the host: RoPE rows and learned positions are gathered at
        ``input_pos``, the new keys and values written there (``index_copy_``), and attention
        reads the cache's whole ``capacity`` with a mask row (key ``j`` visible iff ``j <= pos``).
        The caller reserves the slot before and advances the cache after; its buffers must hold
        finite values (they are zero-filled on allocation). Only the ``"heads"`` hooks run.

        Returns:
            float32 logits ``(B, T, V)``, or ``(B, 1, V)`` with ``last_only`` (or ``input_pos``).

        Raises:
            CacheLimitError: the cache cannot hold ``T`` more tokens.
            ValueError: positions past the model's maximum context.
        """
        B, T = input_ids.shape
        mask = None
        if input_pos is not None:  # the static step: positions are a tensor
            slots = torch.arange(cache.capacity, device=input_pos.device)
            mask = (slots <= input_pos).view(1, 1, 1, cache.capacity)  # (1, 1, 1, capacity)
            start = 0
        else:
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
            rows = self.pos_embed.weight[start : start + T] if input_pos is None else \
                self.pos_embed.weight.index_select(0, input_pos)
            x = x + rows.to(self.compute_dtype)
        hooks = self.hooks.for_cache(cache) if input_pos is None else self.hooks.here()
        ropes: dict[RopeSpec | None, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for i, block in enumerate(self.blocks):
            spec = self.layer_ropes[i]
            if spec not in ropes:  # one per variant: (T, R) each
                ropes[spec] = self._rope_rows(i, start, T, input_pos)
            x = block(x, ropes[spec], cache, i, hooks, input_pos, mask)
        if cache is not None and input_pos is None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        return self._logits(x)  # (B, T, V)

    @property
    def observer(self) -> AttentionObserver | None:
        """The ``"weights"`` hook's callable (:mod:`runtime.model.hooks`; the attention capture
        registers one with ``last_row_only`` as it needs), or None. Set: a hook on every row."""
        hook = self.hooks.find("weights")
        return None if hook is None else hook.fn

    @observer.setter
    def observer(self, fn: AttentionObserver | None) -> None:
        self.hooks.replace("weights", fn)

    def static_ok(self, cache: KVCache) -> bool:
        """Whether the static step (``forward`` with ``input_pos``) computes what the eager one
        does on ``cache``: no hook runs Python per layer, slot ``j`` holds position ``j`` in a
        float buffer that only grows, and no RoPE depends on the length (longrope)."""
        return not self.hooks.for_cache(cache) and cache.fixed_slots and not self._length_rope

    def _rope_rows(self, layer: int, start: int, T: int, input_pos: torch.Tensor | None):
        """Layer ``layer``'s cos, sin rows for positions ``start .. start + T - 1``, or gathered at
        the tensor ``input_pos`` (``(1, R)`` each; the static step's); None for GPT-2."""
        if input_pos is None:
            return self.rope(layer, start, T)
        table = self.rope(layer, 0, self.cfg.max_position_embeddings)
        return None if table is None else (table[0].index_select(0, input_pos), table[1].index_select(0, input_pos))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``(B, T, V)`` of final-normed ``x (B, T, C)``: the LM head (the
        measured CPU kernels when chosen, int8 rows times their scales), divided by Granite's
        ``logits_scaling``, then Gemma's soft-cap."""
        head_module = self._head()
        if isinstance(head_module, (QuantEmbedding, QuantLinear)):  # a GGUF's own blocks
            logits = (head_module.head if isinstance(head_module, QuantEmbedding) else head_module)(x).float()
        elif self.kernels is not None and kernel_path(x, head_module.weight):
            logits = apply_kernel(self.kernels, x, self._head_ref, None).float()
        else:
            head, scale = head_module.weight, getattr(head_module, "weight_scale", None)
            logits = linear(x, head if scale is None else dequantized(head, scale, x.dtype), path=self.linear_path).float()
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
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
        self.numerics.linear_path = path

    def use_profile(self, profile: DeviceProfile) -> None:
        """Compute as ``profile`` (:func:`runtime.device.device_profile`) says: its matrix-product
        path (:meth:`set_linear_path`) and, in its reproducible variant, the row-invariant
        attention and exact activations in every layer (:class:`runtime.model.layers.Numerics`;
        the matrix products follow :meth:`set_kernels` with a reproducible choice): a token's
        logits then have the same bits whether it came in a prefill, a chunk or a one-token step
        (:mod:`runtime.kernels.invariant`). The reproducible variant: CPU, float32 activations,
        eager decode only."""
        self.set_linear_path(profile.linear_path)
        self.profile = profile
        self.numerics.reproducible = profile.reproducible

    @property
    def linear_path(self) -> str:
        """The matrix products' path (:meth:`set_linear_path`)."""
        return self.numerics.linear_path

    @property
    def reproducible(self) -> bool:
        """Whether the decoder computes in its profile's reproducible variant."""
        return self.numerics.reproducible

    def set_attention_kernels(self, kernels: AttentionKernels) -> None:
        """Use ``kernels`` (:class:`runtime.model.attention.AttentionKernels`) in every layer."""
        for block in self.blocks:
            block.attn.kernels = kernels

    @torch.inference_mode()
    def shift_key_positions(self, cache: KVCache, start: int, end: int, delta: int) -> None:
        """Re-rotate cached keys at positions ``start .. end-1`` by ``delta`` positions (in place),
        each layer with its own variant (:func:`runtime.model.rope.shift_cached_keys`)."""
        shift_cached_keys(self.layer_ropes, self.cfg.head_dim, cache, start, end, delta)
