"""How likely a model finds each token of a text, given the tokens before it: the prompt's
log-probabilities that OpenAI's ``/v1/completions`` returns with ``echo`` and ``logprobs``.

Must not import Qt.
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime.generate.logits_processors import TokenLogprob
from runtime.loader.model import Model

#: Positions scored per forward pass: their float32 logits (256 x the vocabulary: 50 MB for
#: the default model) are the peak this adds.
CHUNK = 256


@torch.inference_mode()
def token_logprobs(model: Model, ids: Sequence[int], top: int = 0, *, chunk: int = CHUNK) -> list[TokenLogprob | None]:
    """Entry ``i``: token ``ids[i]``'s natural-log probability given ``ids[:i]`` (the model's
    distribution at temperature 1, log-softmaxed in float32) with the ``top`` most likely
    alternatives there, most likely first; ``None`` for ``ids[0]`` (nothing before it).

    Runs the model over ``ids`` on a cache of its own (the session's is left alone), ``chunk``
    positions at a time.

    Raises:
        ValueError: ``top`` outside 0-20; ``ids`` longer than the model's context.
    """
    if not 0 <= top <= 20:
        raise ValueError(f"top must be between 0 and 20, got {top!r}")
    ids = list(ids)
    out: list[TokenLogprob | None] = [None] if ids else []
    if len(ids) < 2:
        return out
    cache = model.new_cache(len(ids))
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]  # the last token predicts nothing asked for
        logp = torch.log_softmax(model.logits(piece, cache)[0].float(), dim=-1)  # (T, V)
        nxt = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
        chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
        if top:
            values, alts = torch.topk(logp, top, dim=-1)
            tops = [list(zip(a, v)) for a, v in zip(alts.tolist(), values.tolist())]
        else:
            tops = [[] for _ in piece]
        out.extend(TokenLogprob(t, lp, tp) for t, lp, tp in zip(nxt.tolist(), chosen, tops))
    cache.release()
    return out
