"""The KV cache: per-layer key and value buffers written in place, with exact byte accounting.

Must not import Qt.

Layout: for each layer one K and one V buffer ``(B, Hkv, capacity, D)``; tokens
``0 .. length-1`` are valid. Keys are stored after RoPE (so a decode step reads them
as they are).

Why grow in chunks instead of preallocating the whole context: an 8,192-token
float32 cache of the default model is 8192 x 46,080 B = 360 MiB, most of which a
short chat never uses, and the memory panel should show what a conversation really
costs. Why not ``torch.cat`` per token: that copies the whole cache every step
(O(T^2) bytes over a reply). Growing by ``chunk_tokens`` copies each token at most
``capacity / chunk_tokens`` times and keeps every decode step an in-place write.

Every buffer operation runs under ``torch.inference_mode``; the buffers themselves are
normal tensors (no autograd history, writable from any caller), since a compiled decode
step cannot write into views of inference tensors.
"""
from __future__ import annotations

import torch

from runtime import memory
from runtime.dtypes import CACHE_DTYPES, dtype_name, parse_cache_dtype  # noqa: F401  (re-exported: callers import them from here)
from runtime.errors import CacheLimitError

def _free_bytes(device: torch.device) -> int | None:
    """Bytes a new buffer can take on ``device`` (None if unknown).

    CUDA: the driver's free memory plus what torch's caching allocator holds unused
    (it hands that out first, so the driver's figure alone would refuse too early).
    """
    free = memory.free_memory_bytes(device)
    if free is not None and device.type == "cuda":
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free


class KVCache:
    """Per-layer K/V buffers ``(B, Hkv, capacity, D)`` with an explicit ``length``.

    Args:
        n_layers, n_kv_heads, head_dim: the model's shape.
        max_tokens: the most tokens the cache may hold (its context capacity).
        dtype: element dtype of the buffers.
        device: where the buffers live.
        batch: batch size ``B``.
        limit_bytes: optional cap on ``allocated_bytes``; ``None`` = no cap.
        chunk_tokens: capacity grows in multiples of this many tokens.

    Raises:
        ValueError: non-positive sizes.
        CacheLimitError: ``limit_bytes`` smaller than one token.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
        limit_bytes: int | None = None,
        chunk_tokens: int = 256,
    ):
        if min(n_layers, n_kv_heads, head_dim, batch, chunk_tokens) <= 0:
            raise ValueError("KV cache sizes must be positive")
        if max_tokens <= 0:
            raise ValueError(f"a KV cache must hold at least one token; got max_tokens={max_tokens}")
        self.n_layers, self.n_kv_heads, self.head_dim, self.batch = n_layers, n_kv_heads, head_dim, batch
        self.dtype = parse_cache_dtype(dtype)
        self.device = torch.device(device)
        self.max_tokens = int(max_tokens)
        self.chunk_tokens = int(chunk_tokens)
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        if self.limit_bytes is not None and self.limit_bytes < self.bytes_per_token:
            raise CacheLimitError(
                f"the KV-cache limit of {self.limit_bytes} bytes is smaller than one token "
                f"({self.bytes_per_token} bytes); raise the limit"
            )
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    # ---- byte accounting -------------------------------------------------------------
    @property
    def element_bytes(self) -> int:
        """Bytes of one element of the buffers' dtype."""
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x batch x KV heads x head dim x element bytes."""
        return 2 * self.n_layers * self.batch * self.n_kv_heads * self.head_dim * self.element_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the valid tokens: ``bytes_per_token * length``."""
        return self.bytes_per_token * self.length

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take: ``bytes_per_token * capacity``."""
        return self.bytes_per_token * self.capacity

    @property
    def token_limit(self) -> int:
        """The most tokens this cache can ever hold (capacity cap and byte limit)."""
        limit = self.max_tokens
        if self.limit_bytes is not None:
            limit = min(limit, self.limit_bytes // self.bytes_per_token)
        return limit

    # ---- growth ----------------------------------------------------------------------
    @torch.inference_mode()
    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more tokens after ``length`` (grows in chunks).

        Raises:
            CacheLimitError: ``length + n_new`` passes ``max_tokens`` or the byte limit,
                or the grown buffers would not fit the device's free memory (checked
                before allocating; an allocation that fails anyway raises it too).
        """
        need = self.length + n_new
        if need > self.token_limit:
            why = (
                f"the KV-cache memory limit ({self.limit_bytes} bytes = {self.token_limit} tokens)"
                if self.token_limit < self.max_tokens
                else f"the cache capacity of {self.max_tokens} tokens"
            )
            raise CacheLimitError(
                f"{need} tokens would pass {why}; shorten the conversation or raise the limit"
            )
        if need <= self.capacity:
            return
        new_cap = min(self.token_limit, -(-need // self.chunk_tokens) * self.chunk_tokens)
        # Layer by layer, the new K and V buffers exist next to that layer's old ones while
        # its tokens are copied over: the growth plus one layer's old buffers at the peak
        # (all layers at once would briefly double the cache).
        new_bytes = new_cap * self.bytes_per_token
        need_bytes = (new_cap - self.capacity) * self.bytes_per_token + self.capacity * self.bytes_per_token // self.n_layers
        free = _free_bytes(self.device)
        if free is not None and need_bytes > free:
            raise CacheLimitError(
                f"a {new_cap}-token KV cache needs {need_bytes / 2**20:,.1f} MiB more but {self.device} has "
                f"{free / 2**20:,.1f} MiB free; lower the context length or use a smaller cache dtype"
            )
        shape = (self.batch, self.n_kv_heads, new_cap, self.head_dim)
        n = self.length
        for i in range(self.n_layers):
            # A layer grown before an out-of-memory error keeps its bigger buffers: only
            # ``capacity`` tokens of each are used, so the cache stays consistent.
            if i < len(self.k) and self.k[i].shape[2] >= new_cap:
                continue
            try:
                # Zero-filled: the static decode step attends over the whole buffer and
                # masks the unused slots, and a masked slot holding NaN would still poison
                # the output (weight 0 x NaN).
                # Normal tensors, not inference tensors: a compiled decode step
                # (torch.compile) cannot take views of inference tensors it writes to.
                with torch.inference_mode(False):
                    new_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    new_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: CPU allocator
                raise CacheLimitError(
                    f"out of memory allocating a {new_cap}-token KV cache "
                    f"({new_bytes} bytes); lower the context length or use a smaller cache dtype"
                ) from e
            if i < len(self.k):
                new_k[:, :, :n].copy_(self.k[i][:, :, :n])
                new_v[:, :, :n].copy_(self.v[i][:, :, :n])
                self.k[i], self.v[i] = new_k, new_v
            else:
                self.k.append(new_k)
                self.v.append(new_v)
        self.capacity = new_cap

    @torch.inference_mode()
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``(B, Hkv, Tnew, D)`` at ``length`` for one layer.

        The caller must have called :meth:`reserve` for ``Tnew`` and calls
        :meth:`advance` once after the last layer.

        Returns:
            views of all keys and values of that layer, ``(B, Hkv, length + Tnew, D)``.
        """
        t0, t1 = self.length, self.length + k.shape[2]
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, t0:t1].copy_(k)
        vb[:, :, t0:t1].copy_(v)
        return kb[:, :, :t1], vb[:, :, :t1]

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys/values ``(B, Hkv, 1, D)`` at slot ``pos`` (a ``(1,)``
        int64 tensor on the cache's device) of one layer: the static decode step's write,
        whose shapes and addresses do not depend on the position.

        The caller must have called :meth:`reserve` and calls :meth:`advance` after. Not
        wrapped in inference mode (unlike the other writes): it runs inside a compiled step.

        Returns:
            all ``capacity`` slots of that layer's keys and values, ``(B, Hkv, capacity, D)``.
        """
        kb, vb = self.k[layer][:, :, : self.capacity], self.v[layer][:, :, : self.capacity]
        kb.index_copy_(2, pos, k.to(kb.dtype))
        vb.index_copy_(2, pos, v.to(vb.dtype))
        return kb, vb

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as valid (after every layer has written them)."""
        if self.length + n > self.capacity:
            raise CacheLimitError("advance past the reserved capacity (call reserve first)")
        self.length += n

    # ---- editing ---------------------------------------------------------------------
    def crop(self, n: int) -> None:
        """Keep only the first ``n`` tokens (``0 <= n <= length``); memory stays allocated.

        Raises:
            ValueError: ``n`` outside ``0 .. length``.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside 0..{self.length}")
        self.length = n

    @torch.inference_mode()
    def evict(self, start: int, end: int) -> None:
        """Remove tokens ``start .. end-1``, shifting later tokens down (in place).

        Used by the rolling context policy; the caller re-rotates the shifted keys'
        positions (see ``runtime.model.Decoder.shift_positions``).
        """
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"evict({start}, {end}) outside 0..{self.length}")
        n_shift = self.length - end
        for buf in (*self.k, *self.v):
            # clone: source and destination overlap.
            buf[:, :, start : start + n_shift].copy_(buf[:, :, end : self.length].clone())
        self.length -= end - start

    def reset(self) -> None:
        """Forget every token (``length = 0``); memory stays allocated."""
        self.length = 0

    def release(self) -> None:
        """Free the buffers (``length = capacity = 0``)."""
        self.k, self.v = [], []
        self.length = self.capacity = 0

    def stats(self) -> dict:
        """The JSON-ready figures: dtype, bytes_per_token, tokens, used/allocated/limit bytes."""
        return {
            "dtype": dtype_name(self.dtype),
            "bytes_per_token": self.bytes_per_token,
            "tokens": self.length,
            "used_bytes": self.used_bytes,
            "allocated_bytes": self.allocated_bytes,
            "limit_bytes": self.limit_bytes,
        }

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"length={self.length}, capacity={self.capacity}, dtype={dtype_name(self.dtype)})"
        )
