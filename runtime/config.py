"""The decoder's configuration: a frozen dataclass built from a transformers config.

Must not import Qt. Derived values (head_dim, group size) are computed once here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import UnsupportedModelError

#: transformers ``model_type`` -> our decoder family.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gpt2": "gpt2",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer.

    Attributes:
        family: ``"llama"`` (RMSNorm, RoPE, SwiGLU) or ``"gpt2"`` (LayerNorm,
            learned positions, GELU MLP).
        model_type: transformers' ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``gpt2``).
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream.
        n_layers: decoder blocks.
        n_heads: query heads per layer.
        n_kv_heads: key/value heads per layer (``n_heads % n_kv_heads == 0``).
        head_dim: width of one head.
        intermediate_size: width of the MLP's hidden layer.
        max_position_embeddings: the model's maximum context length in tokens.
        norm_eps: epsilon of RMSNorm / LayerNorm.
        rope_theta: RoPE base (llama family only).
        qkv_bias: whether q/k/v projections have a bias (Qwen2, GPT-2).
        o_bias: whether the output projection has a bias (GPT-2).
        mlp_bias: whether MLP projections have a bias (GPT-2).
        tie_word_embeddings: the LM head shares the token embedding matrix.
        activation: MLP activation name (``silu`` or ``gelu_new``).
        bos_token_id / eos_token_ids: special token ids from the config.
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

    @property
    def n_groups(self) -> int:
        """Query heads that share one key/value head (1 = multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """KV-cache bytes one token takes: 2 (K and V) x layers x KV heads x head dim x bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_bytes

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig``.

        Raises:
            UnsupportedModelError: an architecture our decoder does not run (an
                encoder-only model, a sliding-window Mistral, RoPE scaling we lack, ...).
        """
        model_type = getattr(hf, "model_type", None)
        family = FAMILIES.get(model_type or "")
        if family is None:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; attnchat runs decoder-only "
                f"Llama, SmolLM, Mistral, Qwen2 and GPT-2 models: pick one of those"
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
        # Llama family.
        sliding = getattr(hf, "sliding_window", None)
        use_sliding = getattr(hf, "use_sliding_window", model_type == "mistral")
        if sliding is not None and use_sliding and sliding < hf.max_position_embeddings:
            raise UnsupportedModelError(
                f"this {model_type} model uses sliding-window attention ({sliding} tokens), "
                f"which attnchat does not run; pick a model without a sliding window"
            )
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise UnsupportedModelError(
                f"RoPE scaling {rope_type!r} is not supported yet; pick a model with plain RoPE"
            )
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(hf, "rope_theta", None) or 10000.0
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"MLP activation {act!r} is not supported; pick a SwiGLU model")
        n_heads = hf.num_attention_heads
        n_kv = getattr(hf, "num_key_value_heads", None) or n_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        if n_heads % n_kv:
            raise UnsupportedModelError(f"{n_heads} query heads do not divide into {n_kv} KV heads")
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
            max_position_embeddings=hf.max_position_embeddings,
            norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            qkv_bias=bool(getattr(hf, "attention_bias", False)) or model_type == "qwen2",
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            activation="silu",
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
