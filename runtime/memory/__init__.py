"""The memory planner: what a model takes (weights, tokenizer, a reply's peak, the KV cache at a
context) and whether it fits a device, from a config or bare numbers, before anything is loaded.

May import torch, :mod:`runtime.config`, the base modules and :mod:`models` (the KV byte formula,
:mod:`models.kv_bytes`); never the cache, the decoder or Qt.
"""
