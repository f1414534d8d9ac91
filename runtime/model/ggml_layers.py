"""The pieces of a llama-family layer as ggml graph nodes: norms, products, the gated MLP, RoPE.

Must not import Qt. :mod:`runtime.model.ggml_step` (a graph per layer, torch's attention between)
and :mod:`runtime.model.ggml_token` (one graph per token, attention and the KV cache writes in it)
build their graphs from these, so both compute the same formulas: the products are ggml's
``mul_mat`` on the file's blocks (activations rounded per block, as llama.cpp does), the norms,
RoPE and activations ggml's float32 operations (RoPE: ``x * cos + rotate_half(x) * sin`` from the
decoder's own tables).
"""
from __future__ import annotations

import math

from runtime.kernels import ggml_repack
from runtime.kernels.ggml_graph import Graph
from runtime.model.layers import Norm, Scale
from runtime.model.quant_layers import QuantLinear

__all__ = ["norm", "product", "layer_end", "attention_inputs"]


def norm(graph: Graph, x, module: Norm):
    """RMSNorm of ``x`` over ``ne0`` (each row, or each head of a ``(D, heads)`` view)."""
    g = graph.g
    return g.ggml_mul(graph.ctx, g.ggml_rms_norm(graph.ctx, x, module.eps), graph.leaf(module.weight.data))


def _blocks(graph: Graph, part):
    """A ggml tensor over a part's blocks: ``ne0`` = its row length in weights. ggml's repacked
    form of them where it has one here (:mod:`runtime.kernels.ggml_repack`: its interleaved-row
    kernels), else the file's blocks as they are."""
    form = ggml_repack.repacked(part)
    if form is not None:
        return graph.keep(form).tensor
    x = graph.leaf(part.raw, (part.cols, part.rows), part.btype.ggml_type)
    if graph.g.ggml_nbytes(x) != part.raw.numel():
        raise ValueError(f"{part.btype.name} blocks of {part.rows} x {part.cols} do not match ggml's size")
    return x


def product(graph: Graph, layer: QuantLinear, x):
    """``layer``'s product with ``x (in, 1)`` -> ``(out, 1)``: each part's blocks through
    ``mul_mat``, the parts stacked, the bias added."""
    g = graph.g
    outs = [g.ggml_mul_mat(graph.ctx, _blocks(graph, p), x) for p in layer.parts]
    y = outs[0]
    for o in outs[1:]:
        y = g.ggml_concat(graph.ctx, y, o, 0)
    if layer.bias is not None:
        y = g.ggml_add(graph.ctx, y, graph.leaf(layer.bias.data))
    return y


def _geglu_tanh(graph: Graph, gu, n: int):
    """``gelu_tanh(gate) * up`` of ``gu = [gate | up] (2 n, 1)``, the tanh formula written out:
    ggml's own GELU reads a float16 table (1.6e-3 from torch's on N(0, 9) inputs, against
    1.2e-7 here)."""
    g, ctx = graph.g, graph.ctx
    a = g.ggml_view_2d(ctx, gu, n, 1, 2 * n * 4, 0)
    b = g.ggml_view_2d(ctx, gu, n, 1, 2 * n * 4, n * 4)
    cube = g.ggml_mul(ctx, g.ggml_mul(ctx, a, a), a)
    inner = g.ggml_scale(ctx, g.ggml_add(ctx, a, g.ggml_scale(ctx, cube, 0.044715)), math.sqrt(2.0 / math.pi))
    half = g.ggml_scale_bias(ctx, g.ggml_tanh(ctx, inner), 0.5, 0.5)   # (1 + tanh) / 2
    return g.ggml_mul(ctx, g.ggml_mul(ctx, a, half), b)


def _pre(graph: Graph, x, module):
    """``x`` through a layer's norm before attention or the MLP (OLMo 2 has none: ``x``)."""
    return norm(graph, x, module) if isinstance(module, Norm) else x


def _post(graph: Graph, y, module):
    """A residual branch's output ``y`` through its norm after (Gemma, OLMo 2) or its
    multiplier (Granite's :class:`Scale`), or as it is."""
    if isinstance(module, Norm):
        return norm(graph, y, module)
    if isinstance(module, Scale):
        return graph.g.ggml_scale(graph.ctx, y, module.factor)
    return y


def layer_end(graph: Graph, block, x, y):
    """The rest of a layer after attention: ``x (C, 1)`` the layer's input, ``y (H D, 1)`` its
    attention output -> the layer's output ``(C, 1)`` (output projection, post-attention
    norm or multiplier if any, residual add, MLP norm if any, gate/up product, SwiGLU or
    GeGLU, down product, post-MLP norm or multiplier if any, residual add)."""
    g, ctx = graph.g, graph.ctx
    o = _post(graph, product(graph, block.attn.o_proj, y), block.post_attn_norm)
    x = g.ggml_add(ctx, x, o)
    gu = product(graph, block.mlp.gate_up_proj, _pre(graph, x, block.mlp_norm))
    act = g.ggml_swiglu(ctx, gu) if block.mlp.activation == "silu" else _geglu_tanh(graph, gu, block.mlp.intermediate)
    d = _post(graph, product(graph, block.mlp.down_proj, act), block.post_mlp_norm)
    return g.ggml_add(ctx, x, d)


def attention_inputs(graph: Graph, block, x, cos, sin, heads: tuple[int, int, int]):
    """A layer's start: attention norm of ``x (C, 1)`` (if the family has one), the q/k/v
    product, q/k norms (per head, or over the whole query and key: OLMo 2), RoPE (``cos``,
    ``sin``: ``(R,)`` float32 leaves' tensors, the rotated dims ``R <= D``; None: a layer
    without RoPE, SmolLM3's).

    Returns:
        ``(qk, qkv)``: the rotated queries then keys ``(D, H + Hkv)`` (contiguous) and the
        projection's output ``((H + 2 Hkv) D, 1)``, whose last ``Hkv D`` are the values.
    """
    g, ctx = graph.g, graph.ctx
    H, Hkv, D = heads
    qkv = product(graph, block.attn.qkv_proj, _pre(graph, x, block.attn_norm))
    n = H + Hkv
    if block.attn.q_norm is not None and block.attn.qk_norm_whole:
        q = norm(graph, g.ggml_view_2d(ctx, qkv, H * D, 1, H * D * 4, 0), block.attn.q_norm)
        k = norm(graph, g.ggml_view_2d(ctx, qkv, Hkv * D, 1, Hkv * D * 4, H * D * 4), block.attn.k_norm)
        qk = g.ggml_concat(ctx, g.ggml_reshape_2d(ctx, q, D, H), g.ggml_reshape_2d(ctx, k, D, Hkv), 1)
    elif block.attn.q_norm is not None:
        q = norm(graph, g.ggml_view_2d(ctx, qkv, D, H, D * 4, 0), block.attn.q_norm)
        k = norm(graph, g.ggml_view_2d(ctx, qkv, D, Hkv, D * 4, H * D * 4), block.attn.k_norm)
        qk = g.ggml_concat(ctx, q, k, 1)   # (D, H + Hkv)
    else:
        qk = g.ggml_view_2d(ctx, qkv, D, n, D * 4, 0)
    if cos is None:   # no RoPE: the queries and keys as projected (a tensor of their own)
        return g.ggml_cont(ctx, qk), qkv
    R = cos.shape[0]
    half = R // 2
    x1 = g.ggml_view_2d(ctx, qk, half, n, D * 4, 0)
    x2 = g.ggml_view_2d(ctx, qk, half, n, D * 4, half * 4)
    rotated = g.ggml_concat(ctx, g.ggml_neg(ctx, x2), x1, 0)   # rotate_half: (R, heads)
    rot = qk if R == D else g.ggml_view_2d(ctx, qk, R, n, D * 4, 0)
    out = g.ggml_add(ctx, g.ggml_mul(ctx, rot, graph.leaf(cos, (R, 1))),
                     g.ggml_mul(ctx, rotated, graph.leaf(sin, (R, 1))))
    if R != D:
        out = g.ggml_concat(ctx, out, g.ggml_view_2d(ctx, qk, D - R, n, D * 4, R * 4), 0)
    return out, qkv
