"""The KV cache and what its memory costs: buffers grown in chunks, crops and evictions,
int8 storage, sliding windows, byte accounting, and the memory planner.

May import torch, :mod:`runtime.config` and the base modules; never the decoder or Qt.
"""
