"""The decode step of a GGUF's blocks as ggml graphs: one graph per token when the KV cache
allows it, else one per layer with our attention and KV cache between them.

Must not import Qt. The eager step (:meth:`runtime.model.decoder.Decoder.forward`) runs a
token as ~1,700 torch operations on the default model (56 a layer: norms, RoPE's halves,
the products' casts and reshapes, the residual adds), each a dispatch from Python. Here a
float KV cache of one sequence takes the whole token as one ggml graph, its attention and
cache writes included (:mod:`runtime.model.ggml_token`). Any other cache (int8, or one a
policy evicted from) takes a graph per layer: graph ``l`` holds the end of layer ``l - 1``
(output projection, residual add, MLP norm, gate/up product, SwiGLU or GeGLU, down
product, residual add) and the start of layer ``l`` (attention norm, the q/k/v product,
q/k norms, RoPE from our own tables), computed in one call; between two graphs, torch
writes the new key and value into the :class:`runtime.cache.kv_cache.KVCache` and attends
(:meth:`runtime.model.attention.Attention._attend`: the layer's own window, soft-cap and
kernels). Either way the cache, its dtypes, sliding windows and memory figures are the same
as eagerly. The LM head is the decoder's own (:meth:`Decoder._logits`).

The layers' formulas are :mod:`runtime.model.ggml_layers`' (ggml's ``mul_mat`` on the file's
blocks, activations rounded per block as llama.cpp does; norms, RoPE and activations in
float32). The logits agree with the eager step's to rounding (tests).

:func:`runtime.model.quant_layers.ggml_step_unsupported` says why a decoder cannot take this
step (then :class:`GGMLStep` is not made and decode stays eager).
"""
from __future__ import annotations

import torch

from runtime.kernels.ggml_graph import Graph
from runtime.model.ggml_layers import attention_inputs, layer_end, norm
from runtime.model.ggml_token import TokenGraph, cache_unsupported
from runtime.model.quant_layers import ggml_step_unsupported

__all__ = ["GGMLStep"]

class GGMLStep:
    """Decodes one token of ``decoder`` into a KV cache through ggml graphs.

    Built once per decoder (the graphs hold pointers to its weights: a decoder whose
    weights change needs a new step). ``step(token (1, 1) int64, cache) -> float32 logits
    (1, 1, V)``, advancing the cache by one, as ``Decoder.forward`` does. A cache that
    :func:`runtime.model.ggml_token.cache_unsupported` takes runs the whole token as one
    graph (:class:`runtime.model.ggml_token.TokenGraph`, one per cache dtype, built on first
    use); any other (an int8 cache, a policy's evictions) runs a graph per layer with torch's
    attention and cache writes between them (built on first use).

    Raises:
        ValueError: :func:`runtime.model.quant_layers.ggml_step_unsupported` gives a reason.
    """

    def __init__(self, decoder):
        why = ggml_step_unsupported(decoder)
        if why:
            raise ValueError(f"the ggml decode step does not take this model: {why}")
        self.decoder = decoder
        cfg = decoder.cfg
        self.H, self.Hkv, self.D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.x_in = torch.zeros(1, cfg.hidden_size)
        self.y_in = torch.zeros(1, self.H * self.D)
        # One cos and one sin row per RoPE variant, filled per token from the decoder's tables.
        self.rope_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_layer: dict[str, int] = {}   # a layer of each variant, to read its table
        for i in range(cfg.n_layers):
            key = decoder._rope_keys[i]
            if key not in self.rope_rows and decoder.layer_ropes[i] is not None:   # (NoPE layers: none)
                cos, _ = decoder.rope(i, 0, 1)
                R = cos.shape[-1]
                self.rope_rows[key] = (torch.zeros(R), torch.zeros(R))
                self._rope_layer[key] = i
        # Each layer's attention arguments, read once (not rebuilt per layer per token).
        self._attn_kw = [dict(scale=b.attn.scale, window=b.attn.window, softcap=b.attn.softcap)
                         for b in decoder.blocks]
        self.tokens: dict[torch.dtype, TokenGraph] = {}
        self.graphs: list[Graph] = []   # the per-layer graphs, once a cache needed them
        self.qk: list[torch.Tensor] = []    # per layer: (H + Hkv, D), the rotated queries and keys
        self.qkv: list[torch.Tensor] = []   # per layer: the projection's output (values at its end)

    def _build_layers(self) -> None:
        """The per-layer graphs: graph ``l`` holds the end of layer ``l - 1`` and the start of ``l``."""
        dec = self.decoder
        cfg = dec.cfg
        C, n = cfg.hidden_size, cfg.n_layers
        heads = (self.H, self.Hkv, self.D)
        x_prev = None
        for layer in range(n + 1):
            graph = Graph(result_bytes=self._result_bytes(cfg), max_nodes=128)
            x = graph.leaf(self.x_in, (C, 1)) if layer == 0 else graph.leaf(x_prev, (C, 1))
            if layer > 0:
                x = layer_end(graph, dec.blocks[layer - 1], x, graph.leaf(self.y_in, (self.H * self.D, 1)))
            if layer < n:
                cos, sin = self.rope_rows.get(dec._rope_keys[layer], (None, None))
                qk, qkv = attention_inputs(graph, dec.blocks[layer], x, cos, sin, heads)
                graph.output(x)
                graph.output(qk)
                graph.output(qkv)
                x_prev = graph.torch_view(x, (1, C))
                self.qk.append(graph.torch_view(qk, (self.H + self.Hkv, self.D)))
                self.qkv.append(graph.torch_view(qkv, ((self.H + 2 * self.Hkv) * self.D,)))
            else:
                xf = norm(graph, x, dec.final_norm)
                graph.output(xf)
                self.final = graph.torch_view(xf, (1, 1, C))
            self.graphs.append(graph)

    @staticmethod
    def _result_bytes(cfg) -> int:
        widest = max(cfg.hidden_size, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, 2 * cfg.intermediate_size)
        return 4 * widest * 40 + (1 << 16)

    #: When a dict, each call appends its seconds per part to it (``"graphs"``: ggml's work,
    #: in the one-graph token its attention and cache writes too; with per-layer graphs,
    #: ``"cache"``: torch's cache writes and ``"attention"`` between them; ``"head"``: the LM
    #: head; ``"other"``: embedding, RoPE rows, binding the cache, Python): ``attnchat bench
    #: --profile`` reads it. None: nothing timed.
    timings: dict[str, list[float]] | None = None

    def ready(self, cache) -> bool:
        """Whether this token can take the step: no attention hook (an observer, a head edit,
        a cache policy's evictor: Python called per layer, :mod:`runtime.model.hooks`; the
        eager step serves them)."""
        return not self.decoder.hooks.for_cache(cache)

    def token_graph(self, cache) -> TokenGraph | None:
        """The one-graph step for ``cache`` (built on first use per dtype), or None when the
        cache needs the per-layer graphs."""
        if cache_unsupported(cache) is not None:
            return None
        tg = self.tokens.get(cache.dtype)
        if tg is None:
            tg = self.tokens[cache.dtype] = TokenGraph(self, cache.dtype)
        return tg

    def __call__(self, token: torch.Tensor, cache) -> torch.Tensor:
        if self.timings is not None:
            return self._timed(token, cache)
        dec = self.decoder
        self._begin(token, cache)
        tg = self.token_graph(cache)
        if tg is not None:
            final = tg.run(cache)
            cache.advance(1)
            return dec._logits(final)
        if not self.graphs:
            self._build_layers()
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
        tg = self.token_graph(cache)
        parts = dict.fromkeys(("graphs", "head") if tg is not None else ("graphs", "cache", "attention", "head"), 0.0)
        if tg is not None:
            tg.bind(cache)
            a = perf_counter()
            tg.graph.compute()
            parts["graphs"] += perf_counter() - a
            final = tg.final
        else:
            if not self.graphs:
                self._build_layers()
            y_in = self.y_in.view(1, 1, self.H, self.D)
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
            final = self.final
        cache.advance(1)
        a = perf_counter()
        out = dec._logits(final)
        parts["head"] += perf_counter() - a
        total = perf_counter() - t0
        parts["other"] = total - sum(parts.values())
        for k, v in parts.items():
            t.setdefault(k, []).append(v)
        return out
