"""One sequence's KV cache in a :class:`runtime.cache.paged.pool.PagePool`: its page tables.

Must not import Qt. Position ``p`` of a sequence lives in page ``table[g][p // P]`` at slot
``p % P`` of each layer group ``g`` (``P``: the pool's ``page_tokens``). A sliding group keeps
only the pages its window still sees: the entries before ``first_page[g]`` are released (None).

The sequence speaks the part of :class:`runtime.cache.kv_cache.KVCache`'s contract the decoder
uses (``length``, ``windows``, ``start``, ``reserve``, ``update``, ``advance``, no evictor), so a
prefill runs through :meth:`runtime.model.decoder.Decoder.forward` unchanged, and the batched
decode step (:mod:`runtime.model.batch_step`) calls the same three per row. Attention reads
through the page table: :meth:`update` gathers the sequence's pages into one contiguous
``(1, Hkv, n, D)`` tensor per layer (the "gather" kernel: equal bit for bit to the contiguous
cache's keys in float32, a test checks), then the usual attention runs on it.

Sharing: :meth:`adopt` takes the longest run of full pages of a prompt that the pool's prefix
index holds (a system prompt, a conversation sent again); :meth:`fork` shares the first ``n``
tokens of a live sequence, a partly filled last page included. A shared or indexed page is
copied before the first write into it (copy-on-write at the first differing token). Prefix
keys chain each page's tokens onto its parent's key and start from a ``salt`` (the server's
partition), so equal keys mean equal token prefixes and one partition never reads another's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.cache.paged.pool import PagePool
from runtime.errors import CacheLimitError


class PagedSequence:
    """A sequence's page tables over ``pool``.

    Args:
        pool: the model's page pool.
        max_tokens: the most tokens this sequence may hold (its context).
        salt: the root of its prefix keys (sequences with different salts never share pages).

    Raises:
        ValueError: ``max_tokens`` not positive.
    """

    def __init__(self, pool: PagePool, max_tokens: int, *, salt: str = ""):
        if max_tokens <= 0:
            raise ValueError(f"a sequence must hold at least one token; got max_tokens={max_tokens}")
        self.pool = pool
        self.max_tokens = int(max_tokens)
        self.salt = salt
        self.n_layers, self.windows = pool.n_layers, tuple(pool.windows)
        self.dtype, self.device, self.quantized = pool.dtype, pool.device, pool.quantized
        self.length = 0
        #: The token ids whose keys and values the sequence holds (:meth:`record`).
        self.tokens: list[int] = []
        #: Per group: page ids by page index (None: released behind a sliding window).
        self.tables: list[list[int | None]] = [[] for _ in pool.groups]
        #: Per group: the index of its first held page.
        self.first_page = [0] * len(pool.groups)
        #: Per layer: the position of the first key :meth:`update` returns.
        self.start = [0] * self.n_layers
        self.evictor = None  # no cache policy runs on pages
        #: ``(tokens, logits (V,))`` of a prompt's last token when the sequence holds that prompt
        #: (set by its reply; a later identical prompt takes them instead of a one-token step).
        self.prompt_logits: tuple[int, torch.Tensor] | None = None
        self._keys: list = []  # the prefix key of each full page recorded so far
        self._tensors: dict[int, torch.Tensor] = {}  # per group: its held pages as a tensor
        self._slots = None  # (length, n_new, per group (pages, offsets)) of the last reserve()

    # ---- what the decoder reads --------------------------------------------------------
    @property
    def evicts(self) -> bool:
        """Slots are always positions here (no cache policy): False."""
        return False

    @property
    def sliding(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.windows)

    # ---- writes ------------------------------------------------------------------------
    @torch.inference_mode()
    def reserve(self, n_new: int) -> None:
        """Pages for positions ``length .. length + n_new - 1`` in every group: a sliding group
        first releases the pages no new query's window reaches, the partly filled last page
        is copied when shared or indexed, then new pages are allocated.

        Raises:
            CacheLimitError: ``length + n_new`` passes ``max_tokens``, or the pool has no page
                left (the pages taken so far stay with the sequence, inside what it reserved).
        """
        end = self.length + n_new
        if end > self.max_tokens:
            raise CacheLimitError(f"{end} tokens would pass this sequence's context of {self.max_tokens} tokens; "
                                  "shorten the conversation")
        P = self.pool.page_tokens
        for g, grp in enumerate(self.pool.groups):
            table = self.tables[g]
            if grp.window is not None:
                self._release_before(g, max(0, self.length - grp.window + 1) // P)
            last = self.length // P
            if self.length % P and last < len(table) and not self.pool.writable(g, table[last]):
                fresh = self.pool.alloc(g)  # copy-on-write: the first token written differs
                self.pool.copy_page(g, table[last], fresh)
                self.pool.drop(g, table[last])
                table[last] = fresh
                self._tensors.pop(g, None)
            while len(table) * P < end:
                table.append(self.pool.alloc(g))
                self._tensors.pop(g, None)
        # Where the reserved positions go, per group, made once for every layer's write.
        pos = range(self.length, end)
        self._slots = (self.length, n_new, [
            (torch.tensor([t[p // P] for p in pos], dtype=torch.long, device=self.device),
             torch.tensor([p % P for p in pos], dtype=torch.long, device=self.device)) for t in self.tables])

    def _release_before(self, g: int, page_index: int) -> None:
        table = self.tables[g]
        for j in range(self.first_page[g], min(page_index, len(table))):
            if table[j] is not None:
                self.pool.drop(g, table[j])
                table[j] = None
        if page_index > self.first_page[g]:
            self.first_page[g] = page_index
            for i in self.pool.groups[g].layers:
                self.start[i] = page_index * self.pool.page_tokens
            self._tensors.pop(g, None)

    def _held(self, g: int) -> torch.Tensor:
        t = self._tensors.get(g)
        if t is None:
            pages = self.tables[g][self.first_page[g]:]
            t = self._tensors[g] = torch.tensor(pages, dtype=torch.long, device=self.device)
        return t

    @torch.inference_mode()
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values ``(1, Hkv, T, D)`` at positions ``length .. length + T - 1`` of
        ``layer`` (after :meth:`reserve` for ``T``); returns its keys and values for positions
        ``start[layer] .. length + T - 1``, ``(1, Hkv, n, D)`` each (gathered from the pages;
        the pool's dtype, or ``k``'s dequantized from an int8 pool).

        Raises:
            ValueError: a batch other than 1 (a sequence is one row).
            CacheLimitError: no :meth:`reserve` for these ``T`` tokens at ``length``.
        """
        if k.shape[0] != 1:
            raise ValueError(f"a paged sequence takes one row at a time; got a batch of {k.shape[0]}")
        g, P, T = self.pool.group_of[layer], self.pool.page_tokens, k.shape[2]
        if self._slots is None or self._slots[:2] != (self.length, T):
            raise CacheLimitError(f"update() of {T} tokens at {self.length} without reserve() for them")
        pages, offsets = self._slots[2][g]
        self.pool.write(layer, pages, offsets, k[0], v[0])
        first = self.first_page[g] * P
        return self.pool.read(layer, self._held(g), 0, self.length + T - first, k.dtype)

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as written in every layer.

        Raises:
            CacheLimitError: past the reserved pages (call :meth:`reserve` first).
        """
        if any(len(t) * self.pool.page_tokens < self.length + n for t in self.tables):
            raise CacheLimitError("advance past the reserved pages (call reserve first)")
        self.length += n

    def record(self, ids: Sequence[int]) -> None:
        """The token ids just written (after the forward that wrote them): full pages enter the
        prefix index under their prefix's key.

        Raises:
            ValueError: the ids recorded would not match the tokens written.
        """
        self.tokens.extend(int(i) for i in ids)
        if len(self.tokens) != self.length:
            raise ValueError(f"{len(self.tokens)} token ids recorded for {self.length} tokens written")
        P = self.pool.page_tokens
        while (len(self._keys) + 1) * P <= self.length:
            j = len(self._keys)
            key = (self._keys[-1] if self._keys else self.salt, tuple(self.tokens[j * P : (j + 1) * P]))
            self._keys.append(key)
            for g, table in enumerate(self.tables):
                if j < len(table) and table[j] is not None:
                    self.pool.register(g, table[j], key)

    # ---- sharing -----------------------------------------------------------------------
    def adopt(self, ids: Sequence[int], limit: int | None = None) -> int:
        """Take the longest run of full pages of ``ids`` the pool's prefix index holds (at most
        ``limit`` tokens, and always leaving the last id to be fed: its logits choose the next
        token); returns the tokens taken (a multiple of the page size). An empty sequence only.

        Raises:
            ValueError: the sequence is not empty.
        """
        if self.length:
            raise ValueError("adopt() needs an empty sequence")
        P, ids = self.pool.page_tokens, [int(i) for i in ids]
        most = (len(ids) - 1) if limit is None else min(len(ids) - 1, limit)
        keys, key = [], self.salt
        for j in range(max(0, most) // P):
            key = (key, tuple(ids[j * P : (j + 1) * P]))
            keys.append(key)
        n_pages = 0
        for k in range(len(keys), 0, -1):  # the longest run every group holds
            if all(self._findable(g, keys, k) for g in range(len(self.pool.groups))):
                n_pages = k
                break
        for g, grp in enumerate(self.pool.groups):
            first = self._first_needed(g, n_pages * P)
            pages: list[int | None] = [None] * first
            for j in range(first, n_pages):
                page = self.pool.find(g, keys[j])
                self.pool.take(g, page)
                pages.append(page)
            self.tables[g] = pages
            self._set_first(g, first)
        self.length = n_pages * P
        self.tokens = ids[: self.length]
        self._keys = keys[:n_pages]
        return self.length

    def _first_needed(self, g: int, n: int) -> int:
        """The first page index group ``g`` must hold for the next query at position ``n``."""
        w = self.pool.groups[g].window
        return 0 if w is None else max(0, n - w + 1) // self.pool.page_tokens

    def _findable(self, g: int, keys: list, k: int) -> bool:
        return all(self.pool.find(g, keys[j]) is not None
                   for j in range(self._first_needed(g, k * self.pool.page_tokens), k))

    def _set_first(self, g: int, first: int) -> None:
        self._slots = None  # the tables changed: reserve() again before a write
        self.first_page[g] = first
        for i in self.pool.groups[g].layers:
            self.start[i] = first * self.pool.page_tokens
        self._tensors.pop(g, None)

    def fork(self, other: PagedSequence, n: int) -> int:
        """Share the first ``n`` tokens of ``other`` (a live sequence of the same pool and salt):
        the same pages, a reference each, the partly filled last one copied at this sequence's
        first write into it; returns ``n``, or 0 when ``other`` no longer holds a sliding
        window's pages before ``n``. An empty sequence only.

        Raises:
            ValueError: this sequence is not empty, another pool or salt, ``n`` past the
                tokens ``other`` recorded.
        """
        if self.length:
            raise ValueError("fork() needs an empty sequence")
        if other.pool is not self.pool or other.salt != self.salt:
            raise ValueError("fork(): the sequences must share a pool and a salt")
        if not 0 <= n <= len(other.tokens):
            raise ValueError(f"fork(): {n} tokens outside the 0..{len(other.tokens)} recorded")
        P = self.pool.page_tokens
        if any(other.first_page[g] > self._first_needed(g, n) for g in range(len(self.pool.groups))):
            return 0
        for g in range(len(self.pool.groups)):
            first = self._first_needed(g, n)
            pages: list[int | None] = [None] * first
            for j in range(first, -(-n // P)):
                self.pool.take(g, other.tables[g][j])
                pages.append(other.tables[g][j])
            self.tables[g] = pages
            self._set_first(g, first)
        self.length = n
        self.tokens = list(other.tokens[:n])
        self._keys = list(other._keys[: n // P])
        return n

    # ---- editing -----------------------------------------------------------------------
    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens; the pages after them go back to the pool.

        Raises:
            ValueError: ``n`` outside ``0 .. length``, or a sliding group that released pages
                the next query at ``n`` would need (release and start again).
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside 0..{self.length}")
        if any(self.first_page[g] > self._first_needed(g, n) for g in range(len(self.pool.groups))):
            raise ValueError(f"crop({n}): the sliding-window layers released the pages before {n}; release and start again")
        P = self.pool.page_tokens
        for g, table in enumerate(self.tables):
            keep = -(-n // P)
            for page in table[keep:]:
                if page is not None:
                    self.pool.drop(g, page)
            del table[keep:]
            self._tensors.pop(g, None)
        self.length = n
        self._slots = None
        if self.prompt_logits is not None and self.prompt_logits[0] > n:
            self.prompt_logits = None
        del self.tokens[n:]
        del self._keys[n // P:]

    def release(self) -> None:
        """Give every page back to the pool (``length = 0``): a sequence that ended or was cancelled."""
        for g, table in enumerate(self.tables):
            for page in table:
                if page is not None:
                    self.pool.drop(g, page)
            self.tables[g] = []
            self._set_first(g, 0)
        self.length = 0
        self.tokens, self._keys = [], []
        self.prompt_logits = None

    # ---- figures -----------------------------------------------------------------------
    def stats(self) -> dict:
        """``tokens``, ``pages`` (held, every group), ``shared_pages`` (held by another sequence
        too, or indexed for a prefix), ``used_bytes`` (its pages' bytes, shared ones included)."""
        held = shared = used = 0
        for g, table in enumerate(self.tables):
            for page in table:
                if page is not None:
                    held += 1
                    used += self.pool.groups[g].page_bytes
                    shared += self.pool.refs(g, page) > 1
        return {"tokens": self.length, "pages": held, "shared_pages": shared, "used_bytes": used}

    def __repr__(self) -> str:
        return f"PagedSequence(length={self.length}, pages={[len(t) for t in self.tables]})"
