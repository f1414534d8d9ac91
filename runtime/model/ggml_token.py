"""One decoded token of a GGUF's blocks as one ggml graph: every layer, its KV cache writes and
its attention, computed in one call.

Must not import Qt. :class:`runtime.model.ggml_step.GGMLStep` runs a token through a
:class:`TokenGraph` whenever the KV cache allows it (:func:`cache_unsupported`), else through
its graph per layer with torch's attention between them. Why one graph: between two per-layer
graphs, torch wrote the new key and value into the cache and attended (SDPA), ~90 us of
dispatch and thread wake-ups a layer on top of the work itself; in one graph, ggml's threads
go from one node to the next. What the graph holds per layer, in order: the layer's start
(:func:`runtime.model.ggml_layers.attention_inputs`), the new key and value written into the
cache's own buffers at the layer's next slot (``set_rows``), attention over the layer's held
slots (``flash_attn_ext``: one query row, online softmax in float32, grouped-query heads
mapped as torch's ``enable_gqa`` does, the layer's scale, sliding window and soft-cap), and
the layer's end (:func:`runtime.model.ggml_layers.layer_end`). The final norm ends the graph;
the LM head is the decoder's own (:meth:`runtime.model.decoder.Decoder._logits`).

The cache's buffers are torch tensors that move when the cache grows (and differ between
caches): before each compute :meth:`TokenGraph.bind` points the graph's cache leaves at the
cache's buffers and sets each layer's slot index and key count, a few struct fields per layer.
"""
from __future__ import annotations

import math

import torch

from runtime.cache.storage import FloatStorage
from runtime.device import on_cpu
from runtime.kernels.ggml_graph import Graph
from runtime.model.ggml_layers import attention_inputs, layer_end, norm

__all__ = ["TokenGraph", "cache_unsupported"]

#: ggml's type of each cache dtype the graph reads and writes.
_CACHE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_I64 = 27           # GGML_TYPE_I64
_PREC_F32 = 10      # GGML_PREC_F32


def cache_unsupported(cache) -> str | None:
    """Why ``cache`` cannot take a :class:`TokenGraph` token (None: it can): it must hold float
    buffers (float32, float16 or bfloat16) of one sequence on the CPU, with slot ``j`` of a layer
    at position ``start + j`` (no cache policy set or evicted)."""
    if type(cache.storage) is not FloatStorage or cache.dtype not in _CACHE_TYPES:
        return f"a {cache.dtype} cache"
    if cache.batch != 1 or not on_cpu(cache.device):
        return "a batch or a device other than the CPU"
    if cache.evicts or any(cache.slots.mapped(i) for i in range(cache.n_layers)):
        return "a cache policy's evictions"
    return None


class _LayerCache:
    """One layer's cache leaves and the views over them (ctypes structs, written per token)."""

    def __init__(self, k, v, k_set, v_set, k_read, v_read, window: int | None):
        self.planes = (k, v)            # the buffers' leaves (D, capacity, Hkv)
        self.sets = (k_set, v_set)      # set_rows' results: views of the buffers
        self.reads = (k_read, v_read)   # attention's keys and values (D, n, Hkv)
        self.window = window
        self.bound: tuple[int, int, int] | None = None   # (key pointer, value pointer, capacity)


class TokenGraph:
    """Decodes one token of ``step.decoder`` into a KV cache of ``dtype`` in one ggml graph.

    Built from a :class:`runtime.model.ggml_step.GGMLStep` (its inputs: the token's embedding
    row ``x_in``, the RoPE rows): :meth:`run` after the step's ``_begin``. The graph's results
    are fixed memory; :attr:`final` ``(1, 1, C)`` float32 is the final-normed hidden state.

    Raises:
        ValueError: ``dtype`` is not a cache dtype the graph takes.
    """

    def __init__(self, step, dtype: torch.dtype):
        if dtype not in _CACHE_TYPES:
            raise ValueError(f"the ggml token graph does not take a {dtype} cache")
        dec = step.decoder
        cfg = dec.cfg
        H, Hkv, D = step.H, step.Hkv, step.D
        C, n = cfg.hidden_size, cfg.n_layers
        self.dtype, self.D, self.Hkv = dtype, D, Hkv
        self.es = torch.empty((), dtype=dtype).element_size()
        es, gt = self.es, _CACHE_TYPES[dtype]
        widest = max(C, (H + 2 * Hkv) * D, 2 * cfg.intermediate_size)
        # Every node's result has its own memory; pages never written stay unbacked.
        graph = self.graph = Graph(result_bytes=n * (4 * widest * 48) + (1 << 20), max_nodes=72 * n + 64)
        g, ctx = graph.g, graph.ctx
        self.idx = torch.zeros(n, dtype=torch.int64)    # each layer's slot for the new token
        self._idx = self.idx.numpy()
        self.layers: list[_LayerCache] = []
        self.qk: list[torch.Tensor] = []    # per layer: (H + Hkv, D), the rotated queries and keys
        self.qkv: list[torch.Tensor] = []   # per layer: the projection's output (values at its end)
        x = graph.leaf(step.x_in, (C, 1))
        for layer, block in enumerate(dec.blocks):
            attn = block.attn
            cos, sin = step.rope_rows.get(dec._rope_keys[layer], (None, None))   # (None: a NoPE layer)
            qk, qkv = attention_inputs(graph, block, x, cos, sin, (H, Hkv, D))
            self.qk.append(graph.torch_view(qk, (H + Hkv, D)))
            self.qkv.append(graph.torch_view(qkv, ((H + 2 * Hkv) * D,)))
            k, v = graph.slot(gt, (D, 1, Hkv)), graph.slot(gt, (D, 1, Hkv))
            slot = graph.leaf(self.idx[layer:layer + 1], (1,), _I64)
            k_new = g.ggml_view_3d(ctx, qk, D, 1, Hkv, D * 4, D * 4, H * D * 4)
            v_new = g.ggml_view_3d(ctx, qkv, D, 1, Hkv, D * 4, D * 4, (H + Hkv) * D * 4)
            k_set, v_set = g.ggml_set_rows(ctx, k, k_new, slot), g.ggml_set_rows(ctx, v, v_new, slot)
            graph.output(k_set)   # the writes come before the attention that reads them
            graph.output(v_set)
            k_read = g.ggml_view_3d(ctx, k, D, 1, Hkv, D * es, D * es, 0)
            v_read = g.ggml_view_3d(ctx, v, D, 1, Hkv, D * es, D * es, 0)
            q = g.ggml_view_3d(ctx, qk, D, 1, H, D * 4, D * 4, 0)
            scale = attn.scale if attn.scale is not None else 1.0 / math.sqrt(D)
            o = g.ggml_flash_attn_ext(ctx, q, k_read, v_read, None, scale, 0.0, attn.softcap or 0.0)
            g.ggml_flash_attn_ext_set_prec(o, _PREC_F32)
            x = layer_end(graph, block, x, g.ggml_reshape_2d(ctx, o, H * D, 1))
            self.layers.append(_LayerCache(*(t.contents for t in (k, v, k_set, v_set, k_read, v_read)),
                                           window=attn.window))
        xf = norm(graph, x, dec.final_norm)
        graph.output(xf)
        self.final = graph.torch_view(xf, (1, 1, C))

    def bind(self, cache) -> None:
        """Point the graph at ``cache`` for the token at ``cache.length`` (after its ``reserve(1)``):
        each layer's buffers, its slot ``held`` for the new key and value, and its keys to attend
        over (the held slots and the new one; a sliding layer's last ``window`` of them)."""
        D, es, Hkv = self.D, self.es, self.Hkv
        ks, vs = cache.storage.k, cache.storage.v
        for i, lay in enumerate(self.layers):
            kb, vb = ks[i], vs[i]
            kp, vp, cap = kb.data_ptr(), vb.data_ptr(), kb.shape[2]
            if lay.bound != (kp, vp, cap):
                nb2 = cap * D * es
                for t, p in zip(lay.planes + lay.sets + lay.reads, (kp, vp) * 3):
                    t.data = p
                    t.nb[2], t.nb[3] = nb2, nb2 * Hkv
                for t in lay.planes + lay.sets:
                    t.ne[1] = cap
                lay.bound = (kp, vp, cap)
            held = cache.held(i)
            self._idx[i] = held
            n = held + 1
            kr, vr = lay.reads
            if lay.window is not None and n > lay.window:
                skip = (n - lay.window) * D * es
                kr.data, vr.data = kp + skip, vp + skip
                n = lay.window
            elif kr.data != kp:
                kr.data, vr.data = kp, vp
            kr.ne[1] = vr.ne[1] = n

    def run(self, cache) -> torch.Tensor:
        """The token (its inputs set by the step) through every layer into ``cache``; returns
        :attr:`final`. The caller advances the cache."""
        self.bind(cache)
        self.graph.compute()
        return self.final
