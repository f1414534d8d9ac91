"""Rename and fuse a transformers state dict into the decoder's layout.

Must not import Qt. transformers reads the tensors (GGUF dequantized, or safetensors);
this module only maps names, fuses q/k/v and gate/up, and transposes GPT-2's Conv1D.
"""
from __future__ import annotations

from pathlib import Path

import torch

from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError


def _take(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise ModelLoadError(
            f"the weights have no tensor {name!r}; the file is incomplete or not the architecture "
            f"its config says: re-download or re-export it"
        ) from None


def _strip_prefix(sd: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        out[name] = t
    return out


def to_decoder_state(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers names -> :class:`runtime.model.decoder.Decoder` names, cast to ``dtype``.

    Llama family: ``model.layers.N.self_attn.{q,k,v}_proj`` fused into
    ``blocks.N.attn.qkv_proj``; ``mlp.{gate,up}_proj`` into ``blocks.N.mlp.gate_up_proj``
    (Phi-3 stores both fused already); Qwen3/Gemma 3 q/k head norms (OLMo 2's over the whole
    projection); Gemma's four norms per layer (its ``post_attention_layernorm`` follows
    attention, Llama's precedes the MLP); OLMo 2's two, after attention and the MLP.
    GPT-2: ``h.N.attn.c_attn`` (a Conv1D, ``(in, out)``) transposed into
    ``qkv_proj``; ``mlp.c_fc`` / ``mlp.c_proj`` into ``gate_up_proj`` / ``down_proj``.

    Raises:
        ModelLoadError: a tensor is missing.
    """
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.to(dtype).contiguous()

    if cfg.family == "llama":
        sd = _strip_prefix(sd, ("model.language_model.", "model."))
        put("embed.weight", _take(sd, "embed_tokens.weight"))
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            b = f"blocks.{i}."
            if not cfg.pre_norms:  # OLMo 2: a norm after attention and after the MLP only
                put(b + "post_attn_norm.weight", _take(sd, p + "post_attention_layernorm.weight"))
                put(b + "post_mlp_norm.weight", _take(sd, p + "post_feedforward_layernorm.weight"))
            elif cfg.sandwich_norms:  # Gemma: post_attention_layernorm follows attention
                put(b + "attn_norm.weight", _take(sd, p + "input_layernorm.weight"))
                put(b + "post_attn_norm.weight", _take(sd, p + "post_attention_layernorm.weight"))
                put(b + "mlp_norm.weight", _take(sd, p + "pre_feedforward_layernorm.weight"))
                put(b + "post_mlp_norm.weight", _take(sd, p + "post_feedforward_layernorm.weight"))
            else:  # Llama: post_attention_layernorm is the norm before the MLP
                put(b + "attn_norm.weight", _take(sd, p + "input_layernorm.weight"))
                put(b + "mlp_norm.weight", _take(sd, p + "post_attention_layernorm.weight"))
            if p + "self_attn.qkv_proj.weight" in sd:  # Phi-3 stores q/k/v fused, as we do
                put(b + "attn.qkv_proj.weight", sd[p + "self_attn.qkv_proj.weight"])
            else:
                put(b + "attn.qkv_proj.weight", torch.cat([_take(sd, p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if cfg.qkv_bias:
                put(b + "attn.qkv_proj.bias", torch.cat([_take(sd, p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            if cfg.qk_norm:
                put(b + "attn.q_norm.weight", _take(sd, p + "self_attn.q_norm.weight"))
                put(b + "attn.k_norm.weight", _take(sd, p + "self_attn.k_norm.weight"))
            put(b + "attn.o_proj.weight", _take(sd, p + "self_attn.o_proj.weight"))
            if cfg.o_bias:
                put(b + "attn.o_proj.bias", _take(sd, p + "self_attn.o_proj.bias"))
            if p + "mlp.gate_up_proj.weight" in sd:  # Phi-3: gate and up fused, gate first
                put(b + "mlp.gate_up_proj.weight", sd[p + "mlp.gate_up_proj.weight"])
            else:
                put(b + "mlp.gate_up_proj.weight", torch.cat([_take(sd, p + "mlp.gate_proj.weight"), _take(sd, p + "mlp.up_proj.weight")]))
            put(b + "mlp.down_proj.weight", _take(sd, p + "mlp.down_proj.weight"))
            if cfg.mlp_bias:
                put(b + "mlp.gate_up_proj.bias", torch.cat([_take(sd, p + "mlp.gate_proj.bias"), _take(sd, p + "mlp.up_proj.bias")]))
                put(b + "mlp.down_proj.bias", _take(sd, p + "mlp.down_proj.bias"))
        put("final_norm.weight", _take(sd, "norm.weight"))
        if not cfg.tie_word_embeddings:
            put("lm_head.weight", _take(sd, "lm_head.weight"))
        return out

    # GPT-2 family: Conv1D weights are stored (in, out); nn.Linear wants (out, in).
    sd = _strip_prefix(sd, ("transformer.",))
    put("embed.weight", _take(sd, "wte.weight"))
    put("pos_embed.weight", _take(sd, "wpe.weight"))
    for i in range(cfg.n_layers):
        p = f"h.{i}."
        b = f"blocks.{i}."
        put(b + "attn_norm.weight", _take(sd, p + "ln_1.weight"))
        put(b + "attn_norm.bias", _take(sd, p + "ln_1.bias"))
        put(b + "mlp_norm.weight", _take(sd, p + "ln_2.weight"))
        put(b + "mlp_norm.bias", _take(sd, p + "ln_2.bias"))
        put(b + "attn.qkv_proj.weight", _take(sd, p + "attn.c_attn.weight").t())
        put(b + "attn.qkv_proj.bias", _take(sd, p + "attn.c_attn.bias"))
        put(b + "attn.o_proj.weight", _take(sd, p + "attn.c_proj.weight").t())
        put(b + "attn.o_proj.bias", _take(sd, p + "attn.c_proj.bias"))
        put(b + "mlp.gate_up_proj.weight", _take(sd, p + "mlp.c_fc.weight").t())
        put(b + "mlp.gate_up_proj.bias", _take(sd, p + "mlp.c_fc.bias"))
        put(b + "mlp.down_proj.weight", _take(sd, p + "mlp.c_proj.weight").t())
        put(b + "mlp.down_proj.bias", _take(sd, p + "mlp.c_proj.bias"))
    put("final_norm.weight", _take(sd, "ln_f.weight"))
    put("final_norm.bias", _take(sd, "ln_f.bias"))
    return out


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 weights: every projection matrix, the LM head and the token embeddings become
    int8 codes ``(out, in)`` plus ``<name>_scale`` ``(out,)`` float32, one symmetric scale
    per output row (per token row for the embeddings; :func:`runtime.quantize.quantize_int8`).
    Norm weights, biases and GPT-2's learned positions stay float32.
    """
    from runtime.quantize import quantize_int8

    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("_proj.weight", "lm_head.weight")) or name == "embed.weight":
            codes, scale = quantize_int8(t)
            out[name], out[name + "_scale"] = codes.contiguous(), scale.squeeze(1).contiguous()
        else:
            out[name] = t.to(torch.float32)
    return out


def decoder_state(path: Path, cfg: ModelConfig, tensors, wdtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        if wdtype == torch.int8:
            return quantize_state(to_decoder_state(cfg, tensors, torch.float32))
        return to_decoder_state(cfg, tensors, wdtype)
    except ModelLoadError as e:  # name the file in the message
        raise ModelLoadError(f"{path.name}: {e}") from None
