"""The KV cache: buffers grown in chunks, crops, sliding windows, and the parts it owns (float or
int8 storage, the slot map a policy's evictions leave, byte figures); the cache policies
(:mod:`.policies`); the paged cache for several sequences at once (:mod:`.paged`).

May import torch, :mod:`runtime.config`, the base modules and :mod:`models` (the KV byte
formula); never the decoder or Qt.
"""
