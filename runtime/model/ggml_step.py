"""The decode step of a GGUF's blocks as ggml graphs, one per layer, with our attention and KV
cache between them.

Must not import Qt. The eager step (:meth:`runtime.model.decoder.Decoder.forward`) runs a
token as ~1,700 torch operations on the default model (56 a layer: norms, RoPE's halves,
the products' casts and reshapes, the residual adds), each a dispatch from Python. Here
everything of a layer but attention is ggml's: graph ``l`` holds the end of layer ``l - 1``
(output projection, residual add, MLP norm, gate/up product, SwiGLU or GeGLU, down
product, residual add) and the start of layer ``l`` (attention norm, the q/k/v product,
q/k head norms, RoPE from our own tables), computed in one call. Between two graphs, torch
writes the new key and value into the :class:`runtime.cache.kv_cache.KVCache` and attends
(:meth:`runtime.model.attention.Attention._attend`: the layer's own window, soft-cap and
kernels), so the cache, its dtypes, sliding windows and memory figures are the same as
eagerly. The LM head is the decoder's own (:meth:`Decoder._logits`).

The products are ggml's ``mul_mat`` on the file's blocks (activations rounded per block
as llama.cpp does, the ``ggml`` decode kernel's arithmetic); norms, RoPE and activations
are ggml's float32 operations (RoPE: ``x * cos + rotate_half(x) * sin`` from the same
tables as the eager path). The logits agree with the eager step's to rounding (tests).

:func:`unsupported` says why a decoder cannot take this step (then :class:`GGMLStep` is
not made and decode stays eager).
"""
from __future__ import annotations

import math

import torch

from runtime.kernels import ggml_ops
from runtime.kernels.ggml_graph import Graph
from runtime.model.layers import Norm
from runtime.model.quant_layers import QuantLinear

__all__ = ["GGMLStep", "unsupported"]

_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new")


def unsupported(decoder) -> str | None:
    """Why ``decoder`` cannot decode through :class:`GGMLStep` (None: it can).

    It needs ggml's kernels, the llama family (RMSNorm, RoPE, a gated MLP with SiLU or
    tanh-GELU), float32 activations on the CPU, every projection in GGUF blocks
    (:class:`runtime.model.quant_layers.QuantLinear`) and the reproducible mode off (its
    products are row-invariant kernels, not ggml's)."""
    if not ggml_ops.available():
        return f"ggml is unavailable ({ggml_ops.unavailable_reason()})"
    cfg = decoder.cfg
    if cfg.family != "llama" or cfg.activation not in _ACTIVATIONS:
        return f"the {cfg.family} family with {cfg.activation} is not built as a ggml graph"
    if decoder.compute_dtype != torch.float32:
        return "activations are not float32"
    if decoder.reproducible:
        return "the reproducible mode runs its own row-invariant kernels"
    for block in decoder.blocks:
        for m in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
            if not isinstance(m, QuantLinear) or m.device.type != "cpu":
                return "a projection is not in GGUF blocks on the CPU"
    if any(spec is None for spec in decoder.layer_ropes):
        return "a layer without RoPE"
    return None


def _norm(graph: Graph, x, norm: Norm):
    """RMSNorm of ``x`` over ``ne0`` (each row, or each head of a ``(D, heads)`` view)."""
    g = graph.g
    return g.ggml_mul(graph.ctx, g.ggml_rms_norm(graph.ctx, x, norm.eps), graph.leaf(norm.weight.data))


def _product(graph: Graph, layer: QuantLinear, x):
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


def _blocks(graph: Graph, part):
    """A ggml tensor over a part's raw blocks: ``ne0`` = its row length in weights."""
    x = graph.leaf(part.raw, (part.cols, part.rows), part.btype.ggml_type)
    if graph.g.ggml_nbytes(x) != part.raw.numel():
        raise ValueError(f"{part.btype.name} blocks of {part.rows} x {part.cols} do not match ggml's size")
    return x


class GGMLStep:
    """Decodes one token of ``decoder`` into a KV cache through per-layer ggml graphs.

    Built once per decoder (the graphs hold pointers to its weights: a decoder whose
    weights change needs a new step). ``step(token (1, 1) int64, cache) -> float32 logits
    (1, 1, V)``, advancing the cache by one, as ``Decoder.forward`` does.

    Raises:
        ValueError: :func:`unsupported` gives a reason.
    """

    def __init__(self, decoder):
        why = unsupported(decoder)
        if why:
            raise ValueError(f"the ggml decode step does not take this model: {why}")
        self.decoder = decoder
        cfg = decoder.cfg
        self.H, self.Hkv, self.D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        C = cfg.hidden_size
        self.x_in = torch.zeros(1, C)
        self.y_in = torch.zeros(1, self.H * self.D)
        # One cos and one sin row per RoPE variant, filled per token from the decoder's tables.
        self.rope_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_layer: dict[str, int] = {}   # a layer of each variant, to read its table
        for i in range(cfg.n_layers):
            key = decoder._rope_keys[i]
            if key not in self.rope_rows:
                cos, _ = decoder.rope(i, 0, 1)
                R = cos.shape[-1]
                self.rope_rows[key] = (torch.zeros(R), torch.zeros(R))
                self._rope_layer[key] = i
        # Each layer's attention arguments, read once (not rebuilt per layer per token).
        self._attn_kw = [dict(scale=b.attn.scale, window=b.attn.window, softcap=b.attn.softcap)
                         for b in decoder.blocks]
        self.graphs: list[Graph] = []
        self.qk: list[torch.Tensor] = []    # per layer: (H + Hkv, D), the rotated queries and keys
        self.qkv: list[torch.Tensor] = []   # per layer: the projection's output (values at its end)
        x_prev = None
        n = cfg.n_layers
        for layer in range(n + 1):
            graph = Graph(result_bytes=self._result_bytes(cfg), max_nodes=128)
            x = graph.leaf(self.x_in, (C, 1)) if layer == 0 else graph.leaf(x_prev, (C, 1))
            if layer > 0:
                x = self._layer_end(graph, decoder.blocks[layer - 1], x)
            if layer < n:
                x_node = x
                self._layer_start(graph, decoder, layer, x)
                graph.output(x_node)
                x_prev = graph.torch_view(x_node, (1, C))
            else:
                xf = _norm(graph, x, decoder.final_norm)
                graph.output(xf)
                self.final = graph.torch_view(xf, (1, 1, C))
            self.graphs.append(graph)

    @staticmethod
    def _result_bytes(cfg) -> int:
        widest = max(cfg.hidden_size, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, 2 * cfg.intermediate_size)
        return 4 * widest * 40 + (1 << 16)

    def _layer_end(self, graph: Graph, block, x):
        g, ctx = graph.g, graph.ctx
        o = _product(graph, block.attn.o_proj, graph.leaf(self.y_in, (self.H * self.D, 1)))
        if isinstance(block.post_attn_norm, Norm):
            o = _norm(graph, o, block.post_attn_norm)
        x = g.ggml_add(ctx, x, o)
        gu = _product(graph, block.mlp.gate_up_proj, _norm(graph, x, block.mlp_norm))
        act = g.ggml_swiglu(ctx, gu) if block.mlp.activation == "silu" else _geglu_tanh(graph, gu, block.mlp.intermediate)
        d = _product(graph, block.mlp.down_proj, act)
        if isinstance(block.post_mlp_norm, Norm):
            d = _norm(graph, d, block.post_mlp_norm)
        return g.ggml_add(ctx, x, d)

    def _layer_start(self, graph: Graph, decoder, layer: int, x) -> None:
        g, ctx = graph.g, graph.ctx
        block = decoder.blocks[layer]
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = _product(graph, block.attn.qkv_proj, _norm(graph, x, block.attn_norm))  # ((H + 2 Hkv) D, 1)
        heads = H + Hkv
        q = g.ggml_view_2d(ctx, qkv, D, H, D * 4, 0)
        k = g.ggml_view_2d(ctx, qkv, D, Hkv, D * 4, H * D * 4)
        if block.attn.q_norm is not None:
            q, k = _norm(graph, q, block.attn.q_norm), _norm(graph, k, block.attn.k_norm)
            qk = g.ggml_concat(ctx, q, k, 1)   # (D, H + Hkv)
        else:
            qk = g.ggml_view_2d(ctx, qkv, D, heads, D * 4, 0)
        cos, sin = self.rope_rows[decoder._rope_keys[layer]]
        R = cos.shape[0]
        half = R // 2
        x1 = g.ggml_view_2d(ctx, qk, half, heads, D * 4, 0)
        x2 = g.ggml_view_2d(ctx, qk, half, heads, D * 4, half * 4)
        rotated = g.ggml_concat(ctx, g.ggml_neg(ctx, x2), x1, 0)   # rotate_half: (R, heads)
        rot = qk if R == D else g.ggml_view_2d(ctx, qk, R, heads, D * 4, 0)
        out = g.ggml_add(ctx, g.ggml_mul(ctx, rot, graph.leaf(cos, (R, 1))),
                         g.ggml_mul(ctx, rotated, graph.leaf(sin, (R, 1))))
        if R != D:
            out = g.ggml_concat(ctx, out, g.ggml_view_2d(ctx, qk, D - R, heads, D * 4, R * 4), 0)
        graph.output(out)
        graph.output(qkv)
        self.qk.append(graph.torch_view(out, (heads, D)))
        self.qkv.append(graph.torch_view(qkv, ((H + 2 * Hkv) * D,)))

    #: When a dict, each call appends its seconds per part to it (``"graphs"``: ggml's norms,
    #: products, RoPE and MLP; ``"cache"``: the KV cache's writes; ``"attention"``;
    #: ``"head"``: the final norm's LM head; ``"other"``: embedding, RoPE rows, Python):
    #: ``attnchat bench --profile`` reads it. None: nothing timed.
    timings: dict[str, list[float]] | None = None

    def ready(self, cache) -> bool:
        """Whether this token can take the step: no attention hook (an observer, a head edit,
        a cache policy's evictor: Python called per layer, :mod:`runtime.model.hooks`; the
        eager step serves them)."""
        return not self.decoder.hooks.for_cache(cache)

    def __call__(self, token: torch.Tensor, cache) -> torch.Tensor:
        if self.timings is not None:
            return self._timed(token, cache)
        dec = self.decoder
        self._begin(token, cache)
        H, Hkv, D = self.H, self.Hkv, self.D
        y_in = self.y_in.view(1, 1, H, D)
        self.graphs[0].compute()
        for layer, block in enumerate(dec.blocks):
            keys, values = self._write(layer, cache)
            y_in.copy_(self._attend(layer, block, keys, values, cache).transpose(1, 2))
            self.graphs[layer + 1].compute()
        cache.advance(1)
        return dec._logits(self.final)

    def _begin(self, token: torch.Tensor, cache) -> None:
        """Reserve the token's slot; its embedding and RoPE rows into the graphs' inputs."""
        dec = self.decoder
        cfg = dec.cfg
        start = cache.length
        if start + 1 > cfg.max_position_embeddings:
            raise ValueError(f"{start + 1} tokens pass the model's maximum context of {cfg.max_position_embeddings}")
        cache.reserve(1)
        x = dec.embed(token.view(1, 1))
        if cfg.embed_scale != 1.0:
            torch.mul(x.view(1, -1), cfg.embed_scale, out=self.x_in)
        else:
            self.x_in.copy_(x.view(1, -1))
        for key, (cos_row, sin_row) in self.rope_rows.items():
            cos, sin = dec.rope(self._rope_layer[key], start, 1)
            cos_row.copy_(cos[0])
            sin_row.copy_(sin[0])

    def _write(self, layer: int, cache):
        """The layer's new key and value into the cache; its keys and values to attend over."""
        H, Hkv, D = self.H, self.Hkv, self.D
        k = self.qk[layer][H:].view(1, Hkv, 1, D)
        v = self.qkv[layer][(H + Hkv) * D:].view(1, Hkv, 1, D)
        return cache.update(layer, k, v)

    def _attend(self, layer: int, block, keys, values, cache) -> torch.Tensor:
        """The layer's attention output ``(1, H, 1, D)`` (the layer's own window, scale, soft-cap, kernels)."""
        attn = block.attn
        q = self.qk[layer][:self.H].view(1, self.H, 1, self.D)
        first = None if cache.evicts and cache.windows[layer] is None else cache.start[layer]
        return attn._attend(q, keys, values, first, self._attn_kw[layer])

    def _timed(self, token: torch.Tensor, cache) -> torch.Tensor:
        """:meth:`__call__` with each part's seconds appended to :attr:`timings`."""
        from time import perf_counter

        t = self.timings
        dec = self.decoder
        t0 = perf_counter()
        self._begin(token, cache)
        y_in = self.y_in.view(1, 1, self.H, self.D)
        parts = dict.fromkeys(("graphs", "cache", "attention", "head"), 0.0)
        a = perf_counter()
        self.graphs[0].compute()
        parts["graphs"] += perf_counter() - a
        for layer, block in enumerate(dec.blocks):
            a = perf_counter()
            keys, values = self._write(layer, cache)
            b = perf_counter()
            y_in.copy_(self._attend(layer, block, keys, values, cache).transpose(1, 2))
            c = perf_counter()
            self.graphs[layer + 1].compute()
            d = perf_counter()
            parts["cache"] += b - a
            parts["attention"] += c - b
            parts["graphs"] += d - c
        cache.advance(1)
        a = perf_counter()
        out = dec._logits(self.final)
        parts["head"] += perf_counter() - a
        total = perf_counter() - t0
        parts["other"] = total - sum(parts.values())
        for k, v in parts.items():
            t.setdefault(k, []).append(v)
        return out
