"""One decode step of several sequences as one ggml graph: every row through every layer, each
row's KV writes into its pages and its attention over its own pages, in one call.

Must not import Qt. The eager batched step (:mod:`runtime.model.batch_step`) runs each layer's
norms, RoPE and residual adds as torch operations and each row's page write, page gather and
SDPA in Python, ~60 dispatches a layer plus ~4 per row; at 8 rows on the default model about half
of a step was that overhead, not the products. Here the whole step is one graph (as
:mod:`runtime.model.ggml_token` does for one sequence), with the same formulas:

- the products take the ``B`` rows at once (ggml's ``mul_mat`` over ``(in, B)``: each weight is
  read once a step; its result per row is the same as for that row alone);
- norms, RoPE (each row at its own position: a cos and sin row per row) and the MLP per row;
- the new keys and values of every row written into the pool's arenas at each row's slot
  (``set_rows``: slot = page x page_tokens + offset);
- per row, its keys and values gathered in position order from its pages (``get_rows`` over the
  slots its page table names: the same keys, in the same order, as a contiguous cache holds),
  (a 16-bit pool's cast back to its dtype, exactly), then ``flash_attn_ext`` over them (one
  query row, online softmax in float32, grouped-query heads, the layer's scale and soft-cap),
  as the one-sequence token graph does. (A sliding
  window's last keys are what :meth:`BatchGraph.bind` would list; :func:`unsupported` refuses
  sliding layers until a test checks them: the silu families with one are not in the catalog.)

So a row's hidden state is computed as that sequence's would be alone, whatever else is in the
batch and wherever its pages lie in the arenas. The LM head is the decoder's own.

What changes between steps lives in torch tensors the graph reads (the rows' embeddings, RoPE
rows, slots, slot lists) and in a few struct fields :meth:`BatchGraph.bind` writes: the arenas'
pointers and sizes (they move when the pool grows) and each row's key count.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from runtime.device import on_cpu
from runtime.kernels.ggml_graph import Graph
from runtime.model.ggml_layers import layer_end, norm, product
from runtime.model.layers import Norm

__all__ = ["BatchGraph", "BatchGraphs", "Gather", "unsupported"]

#: ggml's type of each pool dtype the graph reads and writes.
_CACHE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_I32 = 26           # GGML_TYPE_I32
_I64 = 27           # GGML_TYPE_I64
_PREC_F32 = 10      # GGML_PREC_F32
#: Key slots a row's gather buffers grow by.
GROW_TOKENS = 256


def unsupported(decoder, pool) -> str | None:
    """Why ``decoder`` over ``pool`` cannot decode its rows as one graph (None: it can): it needs
    what the one-sequence ggml step needs (:func:`runtime.model.quant_layers.ggml_step_unsupported`), a SiLU
    MLP, no attention head edit, and a float pool on the CPU."""
    from runtime.model.quant_layers import ggml_step_unsupported as step_unsupported

    why = step_unsupported(decoder)
    if why:
        return why
    if decoder.cfg.activation != "silu":
        return f"a {decoder.cfg.activation} MLP is not built for a batch of rows"
    if decoder.pos_embed is not None:
        return "learned position embeddings"
    if any(w is not None for w in decoder.cfg.windows or ()):
        return "sliding-window layers (not checked against the one-sequence graph yet)"
    if any(spec is None for spec in decoder.layer_ropes):
        return "a layer without RoPE"
    for b in decoder.blocks:
        if not isinstance(b.attn_norm, Norm) or getattr(b.attn, "qk_norm_whole", False):
            return "a layer without an attention norm, or query/key norms over the whole projection"
    if any(b.attn.head_edit is not None for b in decoder.blocks):
        return "an attention head edit"
    if pool.dtype not in _CACHE_TYPES or not on_cpu(pool.device):
        return f"a {pool.dtype} pool on {pool.device}"
    return None


class Gather:
    """Row ``b``'s gather buffers, shared by the graphs of every batch size (one computes at a
    time): its keys and values ``(Hkv, cap, D)`` float32 (``get_rows`` gives float32), for a
    16-bit pool the same again in its dtype (what attention reads, as the one-sequence graph
    reads a 16-bit cache), and per layer group its slot list ``(Hkv, cap)`` int32. They grow
    (and move) by :data:`GROW_TOKENS`."""

    def __init__(self, groups: int, Hkv: int, D: int, dtype: torch.dtype = torch.float32):
        self.groups, self.Hkv, self.D, self.dtype = groups, Hkv, D, dtype
        self.cap = 0
        self.k = self.v = self.k_typed = self.v_typed = None
        self.slot_lists: list[torch.Tensor] = []
        self.version = 0   # grown this many times (an address may come back; this count does not)

    def hold(self, need: int) -> None:
        """Room for ``need`` keys."""
        if need > self.cap:
            self.cap = -(-need // GROW_TOKENS) * GROW_TOKENS
            shape = (self.Hkv, self.cap, self.D)
            self.k, self.v = torch.empty(shape), torch.empty(shape)
            if self.dtype != torch.float32:
                self.k_typed, self.v_typed = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
            self.slot_lists = [torch.zeros(self.Hkv, self.cap, dtype=torch.int32) for _ in range(self.groups)]
            self.version += 1


class _Row:
    """One row's gather nodes: per layer group its slot list leaf, per layer its key and value
    gathers (and their casts to a 16-bit pool's dtype)."""

    def __init__(self, graph: Graph, groups: int, Hkv: int):
        self.slots = [graph.slot(_I32, (1, Hkv)) for _ in range(groups)]   # ne0 set per step
        self.gathers: list = []     # (group, key node, value node, their casts or None) per layer
        self.bound = None           # the (Gather, version) the nodes point at

    def point(self, buf: Gather) -> None:
        """Point the nodes at ``buf``'s memory."""
        cap, D, Hkv = buf.cap, buf.D, buf.Hkv
        for t, lst in zip(self.slots, buf.slot_lists):
            c = t.contents
            c.data = lst.data_ptr()
            c.nb[1] = cap * 4
            c.nb[2] = c.nb[3] = cap * 4 * Hkv
        for _, kg, vg, casts in self.gathers:
            pairs = [(kg, buf.k), (vg, buf.v)] + ([(casts[0], buf.k_typed), (casts[1], buf.v_typed)] if casts else [])
            for t, x in pairs:
                es = x.element_size()
                t.data = x.data_ptr()
                t.nb[1] = D * es
                t.nb[2], t.nb[3] = cap * D * es, cap * D * es * Hkv
        self.bound = (buf, buf.version)


class BatchGraph:
    """Decodes one token of each of ``B`` sequences of ``decoder`` over ``pool`` in one graph.

    :meth:`run` takes the tokens and sequences (each reserved for one token) and returns the
    final-normed hidden states ``(B, 1, C)`` float32: graph memory, valid until the next run.

    Raises:
        ValueError: :func:`unsupported` gives a reason, or ``B`` below 1.
    """

    def __init__(self, decoder, pool, B: int, gathers: list[Gather] | None = None):
        why = unsupported(decoder, pool)
        if why or B < 1:
            raise ValueError(f"the batched ggml graph does not take this model: {why or f'{B} rows'}")
        cfg = decoder.cfg
        self.decoder, self.pool, self.B = decoder, pool, B
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        C, n_layers = cfg.hidden_size, cfg.n_layers
        self.H, self.Hkv, self.D = H, Hkv, D
        self.es = torch.empty((), dtype=pool.dtype).element_size()
        gt = _CACHE_TYPES[pool.dtype]
        N = H + 2 * Hkv
        widest = max(C, N * D, 2 * cfg.intermediate_size)
        graph = self.graph = Graph(result_bytes=B * n_layers * 4 * widest * 48 + (1 << 20),
                                   max_nodes=(64 + 8 * B) * n_layers + 64)
        g, ctx = graph.g, graph.ctx
        groups = len(pool.groups)
        self.x_in = torch.zeros(B, C)
        self.new_slots = torch.zeros(groups, B, dtype=torch.int64)   # per group each row's new slot
        self.rope_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_layer: dict[str, int] = {}
        rope_leaves = {}
        for i in range(n_layers):
            key = decoder._rope_keys[i]
            if key not in self.rope_rows:
                R = decoder.rope(i, 0, 1)[0].shape[-1]
                cos, sin = torch.zeros(B, R), torch.zeros(B, R)
                self.rope_rows[key], self._rope_layer[key] = (cos, sin), i
                rope_leaves[key] = (graph.leaf(cos, (R, 1, B)), graph.leaf(sin, (R, 1, B)))
        slot_leaves = [graph.leaf(self.new_slots[j], (B,), _I64) for j in range(groups)]
        self.rows = [_Row(graph, groups, Hkv) for _ in range(B)]
        self.gathers = gathers if gathers is not None else []
        self.gathers += [Gather(groups, Hkv, D, pool.dtype) for _ in range(B - len(self.gathers))]
        self.arenas: list[tuple] = []   # per layer (key leaf, value leaf, their set_rows views, bound)
        x = graph.leaf(self.x_in, (C, B))
        for layer, block in enumerate(decoder.blocks):
            attn = block.attn
            grp = pool.group_of[layer]
            qk, qkv = _attention_inputs(graph, block, x, *rope_leaves[decoder._rope_keys[layer]], (H, Hkv, D), B)
            n = H + Hkv
            k_arena, v_arena = graph.slot(gt, (D, 1, Hkv)), graph.slot(gt, (D, 1, Hkv))
            k_new = g.ggml_view_3d(ctx, qk, D, B, Hkv, n * D * 4, D * 4, H * D * 4)
            v_new = g.ggml_view_3d(ctx, qkv, D, B, Hkv, N * D * 4, D * 4, (H + Hkv) * D * 4)
            k_set = g.ggml_set_rows(ctx, k_arena, k_new, slot_leaves[grp])
            v_set = g.ggml_set_rows(ctx, v_arena, v_new, slot_leaves[grp])
            graph.output(k_set)
            graph.output(v_set)
            scale = attn.scale if attn.scale is not None else 1.0 / math.sqrt(D)
            ys = None
            for b, row in enumerate(self.rows):
                kg = g.ggml_get_rows(ctx, k_set, row.slots[grp])   # (D, keys, Hkv) float32
                vg = g.ggml_get_rows(ctx, v_set, row.slots[grp])
                casts = None
                if gt != _CACHE_TYPES[torch.float32]:   # back to the pool's 16 bits (exact)
                    kc, vc = g.ggml_cast(ctx, kg, gt), g.ggml_cast(ctx, vg, gt)
                    casts = (kc.contents, vc.contents)
                    kg_read, vg_read = kc, vc
                else:
                    kg_read, vg_read = kg, vg
                row.gathers.append((grp, kg.contents, vg.contents, casts))
                q = g.ggml_view_3d(ctx, qk, D, 1, H, D * 4, D * 4, b * n * D * 4)
                o = g.ggml_flash_attn_ext(ctx, q, kg_read, vg_read, None, scale, 0.0, attn.softcap or 0.0)
                g.ggml_flash_attn_ext_set_prec(o, _PREC_F32)
                o = g.ggml_reshape_2d(ctx, o, H * D, 1)
                ys = o if ys is None else g.ggml_concat(ctx, ys, o, 1)
            x = layer_end(graph, block, x, ys)
            self.arenas.append([k_arena.contents, v_arena.contents, k_set.contents, v_set.contents, None])
        xf = norm(graph, x, decoder.final_norm)
        graph.output(xf)
        self.final = graph.torch_view(xf, (B, 1, C))

    # ---- per step ----------------------------------------------------------------------
    def _inputs(self, tokens: Sequence[int], seqs: Sequence) -> None:
        """The rows' embeddings and RoPE rows (each at its sequence's length)."""
        dec = self.decoder
        ids = torch.tensor(list(tokens), dtype=torch.long).view(self.B, 1)
        x = dec.embed(ids).view(self.B, -1)
        if dec.cfg.embed_scale != 1.0:
            torch.mul(x, dec.cfg.embed_scale, out=self.x_in)
        else:
            self.x_in.copy_(x)
        for key, (cos_rows, sin_rows) in self.rope_rows.items():
            for b, s in enumerate(seqs):
                cos, sin = dec.rope(self._rope_layer[key], s.length, 1)
                cos_rows[b].copy_(cos[0])
                sin_rows[b].copy_(sin[0])

    def bind(self, seqs: Sequence) -> None:
        """Point the graph at the pool's arenas and at each row's slots: the new token's slot
        per group, and the slots of the keys it attends to (from its layer's start, a sliding
        window's last ``window``), in position order."""
        pool, D, es, Hkv, P = self.pool, self.D, self.es, self.Hkv, self.pool.page_tokens
        for i, lay in enumerate(self.arenas):
            kb, vb = pool.k[i], pool.v[i]
            kp, vp, cap = kb.data_ptr(), vb.data_ptr(), kb.shape[1] * P
            if lay[4] != (kp, vp, cap):
                for t, p in zip(lay[:4], (kp, vp, kp, vp)):
                    t.data = p
                    t.ne[1] = cap
                    t.nb[2], t.nb[3] = cap * D * es, cap * D * es * Hkv
                lay[4] = (kp, vp, cap)
        for b, (row, s) in enumerate(zip(self.rows, seqs)):
            length = s.length
            spans = []
            for grp, group in enumerate(pool.groups):
                table = s.tables[grp]
                self.new_slots[grp, b] = table[length // P] * P + length % P
                first = s.first_page[grp] * P
                lo = first if group.window is None else max(first, length + 1 - group.window)
                spans.append((grp, first, lo, length + 1 - lo))
            buf = self.gathers[b]
            buf.hold(max(n for *_, n in spans))
            if row.bound != (buf, buf.version):
                row.point(buf)
            for grp, first, lo, n in spans:
                pages = s._held(grp).to(torch.int32)
                slots = (pages.view(-1, 1) * P + torch.arange(P, dtype=torch.int32)).view(-1)
                buf.slot_lists[grp][:, :n] = slots[lo - first : lo - first + n]
                row.slots[grp].contents.ne[0] = n
            for grp, kg, vg, casts in row.gathers:
                kg.ne[1] = vg.ne[1] = row.slots[grp].contents.ne[0]
                if casts:
                    casts[0].ne[1] = casts[1].ne[1] = kg.ne[1]

    def run(self, tokens: Sequence[int], seqs: Sequence) -> torch.Tensor:
        """The rows' tokens through every layer into their sequences (each already reserved for
        one token; the caller advances them); returns :attr:`final`."""
        self._inputs(tokens, seqs)
        self.bind(seqs)
        self.graph.compute()
        return self.final


class BatchGraphs:
    """One :class:`BatchGraph` per batch size, built on first use, over one decoder and pool.

    ``decode(tokens, seqs) -> float32 logits (B, V)``, as :func:`runtime.model.batch_step.decode_rows`.
    """

    def __init__(self, decoder, pool):
        why = unsupported(decoder, pool)
        if why:
            raise ValueError(f"the batched ggml graph does not take this model: {why}")
        self.decoder, self.pool = decoder, pool
        self.graphs: dict[int, BatchGraph] = {}
        self.gathers: list[Gather] = []   # row b's gather buffers, shared by every graph

    def prepare(self, most: int) -> None:
        """Build the graphs of 1 to ``most`` rows now."""
        for B in range(1, most + 1):
            self._graph(B)

    def _graph(self, B: int) -> BatchGraph:
        bg = self.graphs.get(B)
        if bg is None:
            bg = self.graphs[B] = BatchGraph(self.decoder, self.pool, B, self.gathers)
        return bg

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], seqs: Sequence) -> torch.Tensor:
        """Logits of ``tokens[b]`` appended to ``seqs[b]`` (distinct paged sequences of the pool)
        for every row, in one graph.

        Raises:
            ValueError: tokens and sequences of different lengths, none, or a position past the
                model's maximum context (nothing reserved then).
            CacheLimitError: a sequence cannot take one more token (none has advanced).
        """
        B = len(seqs)
        if B == 0 or len(tokens) != B or len({id(s) for s in seqs}) != B:
            raise ValueError(f"one token per distinct sequence; got {len(tokens)} tokens, {B} sequences")
        most = self.decoder.cfg.max_position_embeddings
        if max(s.length for s in seqs) + 1 > most:
            raise ValueError(f"{max(s.length for s in seqs) + 1} tokens pass the model's maximum context of {most}")
        for s in seqs:
            s.reserve(1)
        final = self._graph(B).run(tokens, seqs)
        for s in seqs:
            s.advance(1)
        return self.decoder._logits(final)[:, 0]


def _attention_inputs(graph: Graph, block, x, cos, sin, heads: tuple[int, int, int], B: int):
    """:func:`runtime.model.ggml_layers.attention_inputs` for ``B`` rows: ``x (C, B)``, ``cos``,
    ``sin`` ``(R, 1, B)`` leaves (row ``b`` at its position). Returns the rotated queries then
    keys ``(D, H + Hkv, B)`` (contiguous) and the projection's output ``((H + 2 Hkv) D, B)``."""
    g, ctx = graph.g, graph.ctx
    H, Hkv, D = heads
    N, n = H + 2 * Hkv, H + Hkv
    qkv = product(graph, block.attn.qkv_proj, norm(graph, x, block.attn_norm))
    if block.attn.q_norm is not None:
        q = norm(graph, g.ggml_view_3d(ctx, qkv, D, H, B, D * 4, N * D * 4, 0), block.attn.q_norm)
        k = norm(graph, g.ggml_view_3d(ctx, qkv, D, Hkv, B, D * 4, N * D * 4, H * D * 4), block.attn.k_norm)
        qk = g.ggml_concat(ctx, q, k, 1)   # (D, H + Hkv, B)
    else:
        qk = g.ggml_cont(ctx, g.ggml_view_3d(ctx, qkv, D, n, B, D * 4, N * D * 4, 0))
    R = cos.contents.ne[0]
    half = R // 2
    x1 = g.ggml_view_3d(ctx, qk, half, n, B, D * 4, n * D * 4, 0)
    x2 = g.ggml_view_3d(ctx, qk, half, n, B, D * 4, n * D * 4, half * 4)
    rotated = g.ggml_concat(ctx, g.ggml_neg(ctx, x2), x1, 0)   # rotate_half: (R, heads, B)
    rot = qk if R == D else g.ggml_view_3d(ctx, qk, R, n, B, D * 4, n * D * 4, 0)
    out = g.ggml_add(ctx, g.ggml_mul(ctx, rot, cos), g.ggml_mul(ctx, rotated, sin))
    if R != D:
        out = g.ggml_concat(ctx, out, g.ggml_view_3d(ctx, qk, D - R, n, B, D * 4, n * D * 4, R * 4), 0)
    return out, qkv
