"""The paged KV cache: fixed-size pages from one pool per model, a page table per sequence.

May import torch, the base modules and :mod:`models` (the KV byte formula); never the decoder,
the generator or Qt. vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention") in our runtime:

- :mod:`.pool`: :class:`PagePool`, the pages (per layer group K/V arenas, float or int8),
  their reference counts, the free list, the prefix index and the byte limit.
- :mod:`.sequence`: :class:`PagedSequence`, one sequence's page tables with the
  :class:`runtime.cache.kv_cache.KVCache` contract the decoder calls (``reserve``, ``update``,
  ``advance``), so a prefill runs through the decoder unchanged; attention reads through the
  page table by a gather (:meth:`PagedSequence.update`).
"""
from runtime.cache.paged.pool import PagePool  # noqa: F401
from runtime.cache.paged.sequence import PagedSequence  # noqa: F401
