"""One pool of KV pages per model: the arenas, reference counts, the free list, the prefix index.

Must not import Qt. A page holds the keys and values of ``page_tokens`` consecutive positions of
one sequence in every layer of a *layer group* (the layers sharing a sliding window, or the
full-attention layers): one page id names the same slot in each of the group's per-layer arenas,
as a vLLM block names its slot in every layer's cache. Sliding layers have their own group so
they can release the pages behind their window while the full layers keep theirs.

Arena layout per layer: ``(Hkv, capacity_pages, page_tokens, D)``, so gathering a sequence's
pages along dim 1 gives ``(Hkv, n_pages x page_tokens, D)`` as one contiguous copy
(:meth:`PagePool.read`). An int8 pool stores codes there and one float32 scale per vector in
``(Hkv, capacity_pages, page_tokens, 1)`` (:mod:`runtime.cache.storage` says why per vector).

Life of a page: ``alloc`` (reference count 1) -> shared by other sequences (``take``: +1) ->
``drop`` (-1). At 0 a page that the prefix index names stays *cached* (its contents can serve
the next sequence with the same prefix: vLLM's automatic prefix caching) until the pool needs
room, then it is recycled least recently used first; an unindexed page goes back to the free
list at once. A page that is shared or indexed is never written again: the sequence copies it
first (copy-on-write, :meth:`runtime.cache.paged.sequence.PagedSequence.reserve`).

The memory limit is a limit on the pool: arenas grow in chunks of pages up to ``limit_bytes``
(bytes from :mod:`models.kv_bytes`), and an allocation that finds no free page, no room to
grow and no cached page raises :class:`runtime.errors.CacheLimitError`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models import kv_bytes
from runtime.cache.byte_counts import PAGE_TOKENS as BYTE_COUNTS_PAGE_TOKENS
from runtime.dtypes import QUANTIZED_CACHE_DTYPES, cache_number_bytes, dtype_name, parse_cache_dtype
from runtime.errors import CacheLimitError
from runtime.quantize import dequantize_int8, quantize_int8

#: Tokens per page unless told: vLLM's default block size (:mod:`runtime.cache.byte_counts` counts
#: a contiguous cache's bytes in pages of this size too).
PAGE_TOKENS = BYTE_COUNTS_PAGE_TOKENS
#: Pages an arena grows by at a time.
CHUNK_PAGES = 32


@dataclass
class LayerGroup:
    """The layers sharing one window (None: full attention) and their pages' bookkeeping."""

    window: int | None
    layers: list[int]
    page_bytes: int  # one page in every layer of the group
    capacity: int = 0  # pages the arenas hold
    refs: list[int] = field(default_factory=list)  # per page: its reference count
    free: list[int] = field(default_factory=list)  # pages nobody holds (a stack)
    index: dict = field(default_factory=dict)  # prefix key -> page
    key_of: dict = field(default_factory=dict)  # page -> its prefix key
    cached: OrderedDict = field(default_factory=OrderedDict)  # indexed pages at 0 references, LRU first


class PagePool:
    """The KV pages of one model.

    Args:
        n_layers, n_kv_heads, head_dim: the model's shape.
        page_tokens: tokens per page (:data:`PAGE_TOKENS`).
        dtype: float32, bfloat16, float16 or int8 (codes plus a float32 scale per vector).
        device: where the arenas live.
        windows: per layer its sliding window in tokens or None (full attention).
        limit_bytes: the most bytes the arenas may take (None: no cap).
        chunk_pages: pages an arena grows by at a time.

    Raises:
        ValueError: non-positive sizes, a window list of the wrong length, an unknown dtype.
        CacheLimitError: a limit smaller than one page of every group.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, page_tokens: int = PAGE_TOKENS,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                 windows: Sequence[int | None] | None = None, limit_bytes: int | None = None,
                 chunk_pages: int = CHUNK_PAGES):
        if min(n_layers, n_kv_heads, head_dim, page_tokens, chunk_pages) <= 0:
            raise ValueError("page pool sizes must be positive")
        windows = tuple(windows) if windows else (None,) * n_layers
        if len(windows) != n_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must give {n_layers} layers a window of at least 1 token or None; got {windows}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.page_tokens, self.chunk_pages = int(page_tokens), int(chunk_pages)
        self.dtype = parse_cache_dtype(dtype)
        self.quantized = self.dtype in QUANTIZED_CACHE_DTYPES
        self.device = torch.device(device)
        self.windows = windows
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        elem, scale = cache_number_bytes(self.dtype)
        #: Bytes one token takes in one layer (:func:`models.kv_bytes.layer_bytes_per_token`).
        self.layer_bytes_per_token = kv_bytes.layer_bytes_per_token(n_kv_heads, head_dim, elem, scale)
        by_window: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)
        #: The layer groups, full attention first.
        self.groups = [LayerGroup(w, ls, self.page_tokens * self.layer_bytes_per_token * len(ls))
                       for w, ls in sorted(by_window.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]
        #: Per layer: its group's index.
        self.group_of = [0] * n_layers
        for g, grp in enumerate(self.groups):
            for i in grp.layers:
                self.group_of[i] = g
        if self.limit_bytes is not None and self.limit_bytes < sum(g.page_bytes for g in self.groups):
            raise CacheLimitError(f"a KV pool limit of {self.limit_bytes} bytes is smaller than one page of every "
                                  f"layer ({sum(g.page_bytes for g in self.groups)} bytes); raise the limit")
        # Per layer: the arenas, (Hkv, capacity, P, D) each (codes for int8), and int8's scales.
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.k_scale: list[torch.Tensor | None] = [None] * n_layers
        self.v_scale: list[torch.Tensor | None] = [None] * n_layers
        #: Called when no page is left: releases a sequence kept for reuse and returns True,
        #: or False when there is none (the server's engine sets it).
        self.reclaim = None

    # ---- pages ---------------------------------------------------------------------------
    def alloc(self, g: int) -> int:
        """A page of group ``g`` with reference count 1: a free one, else a new one (the arena
        grows), else the least recently used cached one (its index entry forgotten), else one
        that :attr:`reclaim` gives back (a finished sequence its owner kept for reuse).

        Raises:
            CacheLimitError: none free, the limit reached and nothing cached.
        """
        grp = self.groups[g]
        while not grp.free and not self._grow(g):
            if grp.cached:
                page, _ = grp.cached.popitem(last=False)
                del grp.index[grp.key_of.pop(page)]
                grp.free.append(page)
            elif self.reclaim is None or not self.reclaim():
                break
        if not grp.free:
            raise CacheLimitError(
                f"the KV pool is full ({self.allocated_bytes:,} bytes of {self.limit_bytes:,}, every page in use); "
                "wait for a request to finish, shorten the conversations or raise the memory limit")
        page = grp.free.pop()
        grp.refs[page] = 1
        return page

    def take(self, g: int, page: int) -> None:
        """One more reference to ``page`` (a cached one comes back into use)."""
        grp = self.groups[g]
        if grp.refs[page] == 0:
            grp.cached.pop(page, None)
        grp.refs[page] += 1

    def drop(self, g: int, page: int) -> None:
        """One reference fewer; at 0 the page is cached (indexed) or free."""
        grp = self.groups[g]
        if grp.refs[page] <= 0:
            raise ValueError(f"page {page} of group {g} is not in use")
        grp.refs[page] -= 1
        if grp.refs[page] == 0:
            if page in grp.key_of:
                grp.cached[page] = None
            else:
                grp.free.append(page)

    def writable(self, g: int, page: int) -> bool:
        """Whether one sequence may write into ``page``: held once and not indexed."""
        grp = self.groups[g]
        return grp.refs[page] == 1 and page not in grp.key_of

    def refs(self, g: int, page: int) -> int:
        """``page``'s reference count."""
        return self.groups[g].refs[page]

    # ---- the prefix index ----------------------------------------------------------------
    def find(self, g: int, key) -> int | None:
        """The page of group ``g`` indexed under ``key`` (held or cached), or None; no reference taken."""
        return self.groups[g].index.get(key)

    def register(self, g: int, page: int, key) -> None:
        """Index a full ``page`` under ``key`` (its prefix's tokens); a key already indexed keeps its page."""
        grp = self.groups[g]
        if key not in grp.index and page not in grp.key_of:
            grp.index[key] = page
            grp.key_of[page] = key

    # ---- contents ------------------------------------------------------------------------
    def _grow(self, g: int) -> bool:
        """Grow group ``g``'s arenas by up to :attr:`chunk_pages` pages under the limit; False if none fit."""
        grp = self.groups[g]
        n = self.chunk_pages
        if self.limit_bytes is not None:
            n = min(n, (self.limit_bytes - self.allocated_bytes) // grp.page_bytes)
        if n <= 0:
            return False
        new_cap = grp.capacity + n
        try:
            for i in grp.layers:
                for name, scale in (("k", False), ("v", False)) + ((("k_scale", True), ("v_scale", True))
                                                                   if self.quantized else ()):
                    planes = getattr(self, name)
                    shape = (self.n_kv_heads, new_cap, self.page_tokens, 1 if scale else self.head_dim)
                    with torch.inference_mode(False):
                        buf = torch.zeros(shape, dtype=torch.float32 if scale else self.dtype, device=self.device)
                    if planes[i] is not None:
                        buf[:, : grp.capacity].copy_(planes[i])
                    planes[i] = buf
        except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: the CPU allocator
            raise CacheLimitError(f"out of memory growing the KV pool to {new_cap} pages; "
                                  "lower the memory limit or use a smaller cache dtype") from e
        grp.refs.extend([0] * n)
        grp.free.extend(range(new_cap - 1, grp.capacity - 1, -1))  # the lowest page is popped first
        grp.capacity = new_cap
        return True

    @torch.inference_mode()
    def copy_page(self, g: int, src: int, dst: int) -> None:
        """Copy page ``src``'s contents to ``dst`` in every layer of group ``g`` (copy-on-write)."""
        for i in self.groups[g].layers:
            for planes in self._planes():
                planes[i][:, dst].copy_(planes[i][:, src])

    def _planes(self) -> tuple[list, ...]:
        return (self.k, self.v, self.k_scale, self.v_scale) if self.quantized else (self.k, self.v)

    @torch.inference_mode()
    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store token ``j``'s key and value ``k[:, j]``, ``v[:, j]`` (``(Hkv, n, D)`` each) at slot
        ``offsets[j]`` of page ``pages[j]`` of ``layer`` (``(n,)`` int64 each, on the pool's device)."""
        if self.quantized:
            for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
                q, s = quantize_int8(x)  # (Hkv, n, D) int8, (Hkv, n, 1) float32
                codes[:, pages, offsets] = q
                scales[:, pages, offsets] = s
            return
        self.k[layer][:, pages, offsets] = k.to(self.dtype)
        self.v[layer][:, pages, offsets] = v.to(self.dtype)

    @torch.inference_mode()
    def read(self, layer: int, pages: torch.Tensor, first: int, n: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``n`` tokens from slot ``first`` of the first of ``pages`` (``(m,)``
        int64) of ``layer``, in page order: ``(1, Hkv, n, D)`` each, a contiguous gather; the
        pool's dtype, or ``dtype`` (the model's) dequantized from an int8 pool."""
        H, P, D = self.n_kv_heads, self.page_tokens, self.head_dim
        out = []
        for codes, scales in ((self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])):
            x = codes.index_select(1, pages).view(H, -1, D)[:, first : first + n]  # (Hkv, n, D)
            if self.quantized:
                x = dequantize_int8(x, scales.index_select(1, pages).view(H, -1, 1)[:, first : first + n], dtype)
            out.append(x.unsqueeze(0))
        return out[0], out[1]

    def release_arenas(self) -> int:
        """Free every arena when no page is in use (the cached prefixes are forgotten); returns
        the bytes freed (0 while a sequence holds a page)."""
        if any(any(g.refs) for g in self.groups):
            return 0
        freed = self.allocated_bytes
        for planes in (self.k, self.v, self.k_scale, self.v_scale):
            planes[:] = [None] * self.n_layers
        for i, g in enumerate(self.groups):
            self.groups[i] = LayerGroup(g.window, g.layers, g.page_bytes)
        return freed

    # ---- figures -------------------------------------------------------------------------
    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page position in every layer: ``page_tokens`` x the bytes a token takes
        in all layers (one page of each group)."""
        return sum(g.page_bytes for g in self.groups)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the arenas take: each group's pages x its page bytes."""
        return sum(g.capacity * g.page_bytes for g in self.groups)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages in use (held by a sequence, counted once however shared)."""
        return sum(sum(1 for r in g.refs if r) * g.page_bytes for g in self.groups)

    def stats(self) -> dict:
        """The JSON-ready figures: ``dtype``, ``page_tokens``, ``bytes_per_page``, page counts
        (``used``: held by a sequence, ``shared``: held by more than one, ``cached``: kept for
        a prefix, ``free``: allocated and unused, ``total``: allocated), ``used_bytes``,
        ``allocated_bytes``, ``limit_bytes``, and per layer group the same counts."""
        groups = []
        for g in self.groups:
            used = sum(1 for r in g.refs if r)
            groups.append({"window": g.window, "layers": len(g.layers), "bytes_per_page": g.page_bytes,
                           "pages_used": used, "pages_shared": sum(1 for r in g.refs if r > 1),
                           "pages_cached": len(g.cached), "pages_free": len(g.free), "pages_total": g.capacity})
        out = {"dtype": dtype_name(self.dtype), "page_tokens": self.page_tokens, "bytes_per_page": self.bytes_per_page,
               "used_bytes": self.used_bytes, "allocated_bytes": self.allocated_bytes, "limit_bytes": self.limit_bytes}
        for name in ("pages_used", "pages_shared", "pages_cached", "pages_free", "pages_total"):
            out[name] = sum(g[name] for g in groups)
        out["groups"] = groups
        return out

    def bytes_for(self, tokens: int) -> int:
        """The most bytes one sequence of ``tokens`` tokens holds: per group its pages (a sliding
        group at most its window plus one page either side) x the group's page bytes."""
        P, total = self.page_tokens, 0
        for g in self.groups:
            held = tokens if g.window is None else min(tokens, g.window + 2 * P)
            total += -(-held // P) * g.page_bytes
        return total

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PagePool(page_tokens={self.page_tokens}, dtype={s['dtype']}, used={s['pages_used']}, "
                f"shared={s['pages_shared']}, cached={s['pages_cached']}, total={s['pages_total']})")
