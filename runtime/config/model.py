"""The decoder's configuration: a frozen dataclass built from a transformers config.

Must not import Qt (nor transformers: it reads the attributes of the config object it is
given). Derived values (head_dim, group size, windows per layer) are computed once here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.config.rope import RopeSpec
from runtime.errors import UnsupportedModelError

#: transformers ``model_type`` -> our decoder family. Gemma 3's GGUF reads as
#: ``gemma3_text``; a full Gemma 3 checkpoint (``gemma3``) carries a vision tower.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "gemma2": "llama",
    "gemma3_text": "llama",
    "granite": "llama",
    "olmo2": "llama",
    "smollm3": "llama",
    "gpt2": "gpt2",
}
#: What each family piece needs; the model types listed take it.
_QK_NORM = ("qwen3", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")

#: Layer types (transformers' ``layer_types`` names).
FULL, SLIDING = "full_attention", "sliding_attention"

@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer.

    Attributes:
        family: ``"llama"`` (RMSNorm, RoPE, gated MLP: Llama, Mistral, Qwen2/3, Phi-3,
            Gemma 2/3, Granite 3, OLMo 2, SmolLM3) or ``"gpt2"`` (LayerNorm, learned positions, GELU MLP).
        model_type: transformers' ``model_type`` (``llama``, ``mistral``, ``qwen2``,
            ``qwen3``, ``phi3``, ``gemma2``, ``gemma3_text``, ``granite``, ``olmo2``,
            ``smollm3``, ``gpt2``).
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream.
        n_layers: decoder blocks.
        n_heads: query heads per layer.
        n_kv_heads: key/value heads per layer (``n_heads % n_kv_heads == 0``; 1 is
            multi-query attention, Shazeer 2019).
        head_dim: width of one head.
        intermediate_size: width of the MLP's hidden layer.
        max_position_embeddings: the model's maximum context length in tokens.
        norm_eps: epsilon of RMSNorm / LayerNorm.
        rope_theta: RoPE base of the global layers (llama family only).
        qkv_bias: whether q/k/v projections have a bias (Qwen2, GPT-2).
        o_bias: whether the output projection has a bias (GPT-2).
        mlp_bias: whether MLP projections have a bias (GPT-2).
        tie_word_embeddings: the LM head shares the token embedding matrix.
        activation: MLP activation: ``silu`` (SwiGLU), ``gelu_pytorch_tanh`` (Gemma's
            GeGLU), or GPT-2's ``gelu_new`` / ``gelu``.
        bos_token_id / eos_token_ids: special token ids from the config.
        rope: the global layers' RoPE variant (:class:`runtime.config.rope.RopeSpec`).
        rope_local: the sliding layers' RoPE when it differs (Gemma 3: base 10,000
            against 1,000,000), else None.
        layer_windows: per layer, the sliding window in tokens (a query sees itself and
            the ``window - 1`` keys before it, transformers' ``sliding_window``), or 0 for
            full attention. Empty: every layer full.
        qk_norm: RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
        norm_offset: RMSNorm multiplies by ``offset + w`` (Gemma: 1, computed in float32).
        embed_scale: embeddings are multiplied by this (Gemma: ``sqrt(hidden_size)``).
        sandwich_norms: a norm after attention and after the MLP too (Gemma 2/3).
        attn_scale: the scores' scale (Gemma: ``query_pre_attn_scalar ** -0.5``);
            0: ``1 / sqrt(head_dim)``.
        attn_softcap: attention logit soft-capping ``c tanh(s / c)`` (Gemma 2), 0: none.
        final_softcap: the same on the output logits (Gemma 2), 0: none.
        nope_layers: layers without RoPE, by index (SmolLM3's every fourth: their
            attention sees no positions but the causal mask).
        residual_scale: each residual branch's output (attention's, the MLP's) times this
            before it is added (Granite's ``residual_multiplier``).
        logits_scaling: the output logits divided by this (Granite's ``logits_scaling``).
        pre_norms: a norm before attention and before the MLP; False: none (OLMo 2 norms
            their outputs only, ``sandwich_norms``).
        qk_norm_whole: the q/k RMSNorm runs over each token's whole query (``H x D``) and
            key (``Hkv x D``) projection rather than each head (OLMo 2).
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    activation: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope: RopeSpec | None = None
    rope_local: RopeSpec | None = None
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    nope_layers: tuple[int, ...] = ()
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    pre_norms: bool = True
    qk_norm_whole: bool = False

    @property
    def n_groups(self) -> int:
        """Query heads that share one key/value head (1 = multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, or None (full attention)."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's :meth:`window`."""
        return tuple(self.window(i) for i in range(self.n_layers))

    def layer_rope(self, layer: int) -> RopeSpec:
        """The RoPE variant of layer ``layer`` (Gemma 3's sliding layers have their own)."""
        if self.rope_local is not None and self.window(layer) is not None:
            return self.rope_local
        return self.rope or RopeSpec(theta=self.rope_theta, max_positions=self.max_position_embeddings)

    def to_dict(self) -> dict:
        """JSON-ready fields (:meth:`from_dict` reads them back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From :meth:`to_dict` output after a JSON round trip (lists back to tuples).

        Raises:
            TypeError, ValueError: fields that are not this class's.
        """
        d = dict(d)
        for name in ("eos_token_ids", "layer_windows", "nope_layers"):
            d[name] = tuple(d.get(name) or ())
        for name in ("rope", "rope_local"):
            if isinstance(d.get(name), dict):
                d[name] = RopeSpec.from_dict(d[name])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig``.

        Raises:
            UnsupportedModelError: an architecture our decoder does not run (an
                encoder, a mixture of experts, a RoPE variant or activation we lack, ...).
        """
        model_type = getattr(hf, "model_type", None)
        family = FAMILIES.get(model_type or "")
        if family is None:
            what = "a mixture-of-experts model" if getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) \
                else "an encoder" if getattr(hf, "is_encoder_decoder", False) or model_type in ("bert", "roberta", "t5") \
                else f"model type {model_type!r}"
            raise UnsupportedModelError(
                f"{what} is not supported; attnchat runs decoder-only Llama, SmolLM2/3, Mistral, "
                f"Qwen2/3, Phi-3, Gemma 2/3, Granite 3, OLMo 2 and GPT-2 models: pick one of those"
            )
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if family == "gpt2":
            n_embd = hf.n_embd
            return cls(
                family=family,
                model_type=model_type,
                vocab_size=hf.vocab_size,
                hidden_size=n_embd,
                n_layers=hf.n_layer,
                n_heads=hf.n_head,
                n_kv_heads=hf.n_head,
                head_dim=n_embd // hf.n_head,
                intermediate_size=hf.n_inner or 4 * n_embd,
                max_position_embeddings=hf.n_positions,
                norm_eps=hf.layer_norm_epsilon,
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                tie_word_embeddings=True,
                activation=hf.activation_function,
                bos_token_id=getattr(hf, "bos_token_id", None),
                eos_token_ids=eos_ids,
            )
        gemma = model_type in _GEMMA
        max_pos = hf.max_position_embeddings
        act = getattr(hf, "hidden_activation", None) if gemma else None
        act = act or getattr(hf, "hidden_act", "silu")
        if act == "swish":
            act = "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"MLP activation {act!r} is not supported; pick a SwiGLU or GeGLU model")
        n_heads = hf.num_attention_heads
        n_kv = getattr(hf, "num_key_value_heads", None) or n_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        if n_heads % n_kv:
            raise UnsupportedModelError(f"{n_heads} query heads do not divide into {n_kv} KV heads")
        windows = _layer_windows(hf, model_type, max_pos)
        rope, rope_local = _rope_specs(hf, max_pos)
        if not any(windows):
            rope_local = None
        attn_bias = bool(getattr(hf, "attention_bias", False))
        softcap = getattr(hf, "attn_logit_softcapping", None) if gemma else None
        granite, olmo2 = model_type == "granite", model_type == "olmo2"
        no_rope = getattr(hf, "no_rope_layers", None) if model_type == "smollm3" else None
        nope = tuple(i for i, uses in enumerate(no_rope or ()) if not uses)
        if no_rope is not None and len(no_rope) != hf.num_hidden_layers:
            raise UnsupportedModelError(f"no_rope_layers names {len(no_rope)} layers of {hf.num_hidden_layers}")
        final_softcap = getattr(hf, "final_logit_softcapping", None) if gemma else None
        return cls(
            family=family,
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            n_layers=hf.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            max_position_embeddings=max_pos,
            norm_eps=hf.rms_norm_eps,
            rope_theta=rope.theta,
            qkv_bias=attn_bias or model_type == "qwen2",
            o_bias=attn_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            activation=act,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            rope=rope,
            rope_local=rope_local,
            layer_windows=windows if any(windows) else (),
            qk_norm=model_type in _QK_NORM or olmo2,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=math.sqrt(hf.hidden_size) if gemma else float(hf.embedding_multiplier) if granite else 1.0,
            sandwich_norms=gemma or olmo2,
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else float(hf.attention_multiplier) if granite
            else 0.0,
            attn_softcap=float(softcap or 0.0),
            final_softcap=float(final_softcap or 0.0),
            nope_layers=nope,
            residual_scale=float(hf.residual_multiplier) if granite else 1.0,
            logits_scaling=float(hf.logits_scaling) if granite else 1.0,
            pre_norms=not olmo2,
            qk_norm_whole=olmo2,
        )


def _layer_windows(hf: Any, model_type: str, max_pos: int) -> tuple[int, ...]:
    """Per layer the sliding window (0: full), as transformers' masks apply it.

    Mistral and Phi-3 slide every layer when ``sliding_window`` is set; Qwen2/3 and
    Gemma say per layer in ``layer_types``. A window as long as the context is no window.
    """
    n = hf.num_hidden_layers
    sliding = getattr(hf, "sliding_window", None) or 0
    if not sliding or sliding >= max_pos:
        return (0,) * n
    types = getattr(hf, "layer_types", None)
    if model_type in ("mistral", "phi3") or not types:
        return (int(sliding),) * n
    if len(types) != n or not set(types) <= {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer types {sorted(set(types))} are not supported; attnchat runs full and sliding attention")
    return tuple(int(sliding) if t == SLIDING else 0 for t in types)


def _rope_specs(hf: Any, max_pos: int) -> tuple[RopeSpec, RopeSpec | None]:
    """(global RoPE, sliding layers' RoPE or None), from ``rope_parameters`` (transformers 5:
    one dict, or one per layer type) or the older ``rope_scaling`` + ``rope_theta``."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    partial = float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0)
    orig = getattr(hf, "original_max_position_embeddings", None)

    def spec(p: dict) -> RopeSpec:
        p = dict(p)
        p.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
        if orig and not p.get("original_max_position_embeddings"):
            p["original_max_position_embeddings"] = orig
        return RopeSpec.from_hf(p, max_positions=max_pos, partial_rotary_factor=partial)

    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING)
        return spec(params[FULL]), (spec(local) if local else None)
    return spec(params if isinstance(params, dict) else {}), None
