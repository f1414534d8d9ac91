"""Several replies at once over one model: continuous batching on the paged KV cache.

May import torch, the rest of :mod:`runtime.generate` (sampling, streaming, events), the decoder's
batched step (:mod:`runtime.model.batch_step`), the paged cache (:mod:`runtime.cache.paged`)
and the loaded model; never Qt, never the server.

- :mod:`.reply`: :class:`BatchReply`, one request's reply as a state machine (prefill chunks,
  then one token per step: its own sampling, logits processors, stop strings, limits, figures).
- :mod:`.scheduler`: :class:`Batcher`, which admits replies under the pool's memory, prefills
  one chunk of the oldest new reply per step (a long prompt does not stall the others) and
  decodes every running reply in one call (:func:`runtime.model.batch_step.decode_rows`).
"""
from runtime.generate.batch.reply import BatchReply, ReplyRequest  # noqa: F401
from runtime.generate.batch.scheduler import Batcher  # noqa: F401
