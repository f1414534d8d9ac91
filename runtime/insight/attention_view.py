"""One layer's attention for the attention view: a head's full matrix, the formula's numbers.

Must not import Qt. Nothing here runs during a reply: a :class:`LayerAttention` is one
extra forward over a conversation's token ids with no KV cache (the session's cache is
not touched). The decoder runs on its ordinary fast path up to the layer asked for and
stops there (a forward pre-hook raises once it has that layer's input); the layer's
q, k, v are then recomputed exactly as :class:`runtime.model.attention.Attention` does, and the
weights come from :func:`runtime.model.attention.attention_reference`, the same function the
capture uses.

The formula (Vaswani et al. 2017, eq. 1): ``softmax(q·k / sqrt(d)) v``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from runtime.generate.chat_format import Message, encode_messages
from runtime.loader.model import Model
from runtime.model.attention import attention_reference

__all__ = ["FormulaSteps", "HEAD_REDUCTIONS", "LayerAttention", "context_ids", "conversation_ids", "held_context",
           "kept_share",
           "layer_qkv", "token_strings"]

#: What ``head`` may be besides a head index: the mean or the max over the heads of a layer.
HEAD_REDUCTIONS = ("mean", "max")


class _Reached(Exception):
    """Raised by the pre-hook once the wanted layer's input is in hand (ends the forward early)."""


def _check_layer(model: Model, layer: int) -> None:
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")


@torch.inference_mode()
def layer_qkv(model: Model, ids: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of ``layer`` for ``ids`` (positions ``0..T-1``, no cache).

    Returns:
        q ``(1, H, T, D)``, k and v ``(1, Hkv, T, D)``, in the model's dtype and on its
        device, RoPE applied (llama family) as in the decoder.

    Raises:
        ValueError: an empty ``ids``, a layer out of range, more tokens than the model's context.
    """
    _check_layer(model, layer)
    attn = model.decoder.blocks[layer].attn
    got: dict[str, object] = {}

    def grab(module, args):  # args: (x, rope, cache, layer, observer), x already normed
        got["x"], got["rope"] = args[0], args[1]
        raise _Reached

    handle = attn.register_forward_pre_hook(grab)
    try:
        model.logits(list(ids))
    except _Reached:
        pass
    finally:
        handle.remove()
    return attn.project(got["x"], got["rope"])  # the decoder's own projection and RoPE


class LayerAttention:
    """One layer's q, k, v for a token sequence: the snapshot matrix and the formula's numbers.

    Building it is one forward up to ``layer`` (no cache); :meth:`matrix` and
    :meth:`explain` then cost one head's attention each, so a view can ask for other
    heads and other query tokens of the same layer without another forward.

    Args:
        model: a loaded model.
        ids: the token ids, ``T`` of them (one sequence, positions ``0..T-1``).
        layer: zero-based layer.

    Raises:
        ValueError: empty ``ids``, a layer out of range, more tokens than the model's context.
    """

    def __init__(self, model: Model, ids: Sequence[int], layer: int):
        self.ids = list(ids)
        self.layer = layer
        self.q, self.k, self.v = layer_qkv(model, self.ids, layer)  # (1, H, T, D), (1, Hkv, T, D) x 2
        attn = model.decoder.blocks[layer].attn
        # The layer's own attention: its sliding window (None: full), score scale and soft-cap.
        self.window = getattr(attn, "window", None)
        self.scale = getattr(attn, "scale", None)
        self.softcap = getattr(attn, "softcap", None)
        self.n_heads = self.q.shape[1]
        self.group = self.n_heads // self.k.shape[1]

    def _check_head(self, head: int) -> None:
        if not (isinstance(head, int) and 0 <= head < self.n_heads):
            raise ValueError(f"head {head!r} is outside 0..{self.n_heads - 1}")

    def _weights(self, head: int) -> torch.Tensor:
        """``(T, T)`` float32 weights of query head ``head`` (it reads KV head ``head // G``)."""
        kv = head // self.group
        q, k, v = self.q[:, head : head + 1], self.k[:, kv : kv + 1], self.v[:, kv : kv + 1]
        return attention_reference(q, k, v, scale=self.scale, window=self.window, softcap=self.softcap)[1][0, 0]  # (T, T)

    @torch.inference_mode()
    def matrix(self, head: int | str = 0) -> torch.Tensor:
        """The full causal attention matrix of one head, or ``"mean"`` / ``"max"`` over the heads.

        Returns:
            ``(T, T)`` float32 on the CPU: row = query token, column = key token; the
            upper triangle (future keys) is 0, and in a sliding-window layer so is every
            key more than ``window - 1`` tokens back (the matrix is a band).

        Raises:
            ValueError: a head that is neither an index nor one of :data:`HEAD_REDUCTIONS`.
        """
        if head not in HEAD_REDUCTIONS:
            self._check_head(head)
            return self._weights(head).cpu()
        out = self._weights(0)
        for h in range(1, self.n_heads):  # one head at a time: (T, T) twice in memory, never (H, T, T)
            w = self._weights(h)
            out = out + w if head == "mean" else torch.maximum(out, w)
        return (out / self.n_heads if head == "mean" else out).cpu()

    @torch.inference_mode()
    def explain(self, head: int, query: int = -1, *, top: int = 5) -> "FormulaSteps":
        """The formula's numbers for query token ``query`` (negative: from the end).

        Raises:
            ValueError: a head or query out of range; ``top`` below 1.
        """
        self._check_head(head)
        if top < 1:
            raise ValueError(f"top must be at least 1; got {top}")
        T = len(self.ids)
        i = query + T if query < 0 else query
        if not 0 <= i < T:
            raise ValueError(f"query token {query} is outside 0..{T - 1}")
        kv = head // self.group
        D = self.q.shape[-1]
        scale = self.scale or 1.0 / math.sqrt(D)
        first = max(0, i - self.window + 1) if self.window else 0  # a sliding layer sees its window only
        qi = self.q[0, head, i].float()  # (D,)
        keys, vals = self.k[0, kv, first : i + 1].float(), self.v[0, kv, first : i + 1].float()  # (n, D): the visible keys
        raw = keys @ qi  # (n,)
        scaled = raw * scale
        if self.softcap:  # Gemma 2: c * tanh(s / c)
            scaled = torch.tanh(scaled / self.softcap) * self.softcap
        m = scaled.max()
        e = torch.exp(scaled - m)
        denom = e.sum()
        w = e / denom
        out = w @ vals  # (D,)
        order = torch.argsort(w, descending=True)[:top]
        v_norms = vals.norm(dim=-1)
        return FormulaSteps(
            layer=self.layer, head=head, kv_head=kv, query=i, head_dim=D, scale=scale, n_keys=i + 1 - first,
            keys=(order + first).tolist(), raw=raw[order].tolist(), scaled=scaled[order].tolist(), exp=e[order].tolist(),
            weights=w[order].tolist(), value_norms=v_norms[order].tolist(),
            contribution_norms=(w[order] * v_norms[order]).tolist(),
            max_scaled=float(m), denominator=float(denom), query_norm=float(qi.norm()),
            output_norm=float(out.norm()), top_output_norm=float((w[order] @ vals[order]).norm()),
        )


@dataclass(frozen=True)
class FormulaSteps:
    """``softmax(q·k / sqrt(d)) v`` for one query token of one head, step by step.

    Per key ``j`` (only the ``top`` keys by weight are listed, heaviest first):
    ``raw = q·k_j``; ``scaled = raw * scale`` (``scale = 1/sqrt(d)``);
    ``exp = exp(scaled - max_scaled)``; ``weight = exp / denominator`` (the softmax;
    ``denominator`` sums ``exp`` over all ``n_keys`` visible keys); ``value_norm = |v_j|``;
    ``contribution_norm = weight * |v_j|``. The head's output is ``o = sum_j weight_j v_j``
    over all visible keys (``output_norm = |o|``); ``top_output_norm`` is the norm of the
    same sum over the listed keys only. Norms are Euclidean.
    """

    layer: int
    head: int
    kv_head: int
    query: int
    head_dim: int
    scale: float
    n_keys: int
    keys: list[int]
    raw: list[float]
    scaled: list[float]
    exp: list[float]
    weights: list[float]
    value_norms: list[float]
    contribution_norms: list[float]
    max_scaled: float
    denominator: float
    query_norm: float
    output_norm: float
    top_output_norm: float

    def to_dict(self) -> dict:
        return asdict(self)


def conversation_ids(model: Model, messages: Sequence[Message], system_prompt: str | None = None) -> list[int]:
    """Token ids of a conversation through the chat template, as a session would build them
    (the generation prompt is added when the last message is not a reply)."""
    msgs = ([Message("system", system_prompt)] if system_prompt else []) + list(messages)
    gen = not msgs or msgs[-1].role != "assistant"
    return encode_messages(model.tokenizer, msgs, add_generation_prompt=gen)


def context_ids(session) -> list[int]:
    """The token ids a :class:`runtime.ChatSession`'s KV cache holds, in cache order (the keys
    the newest token attends to; after a rolling eviction, the kept tokens only)."""
    # The session keeps the logical stream and the logical position of each cache slot.
    return session.cached_token_ids


def held_context(conversation: Sequence[int], held: Sequence[int], t: int) -> list[int] | None:
    """Positions (into ``conversation``) of the context the model had for ``conversation[t]``
    when its cache held ``held`` (:func:`context_ids` after the last reply), or None when that
    context is simply ``conversation[:t]``.

    Rolling overflow keeps the first tokens (the sinks) and the newest window; truncate-middle
    keeps the start and the latest turns: ``held`` is then a prefix of the conversation and one
    later contiguous run of it. The context for ``t`` is that prefix and the conversation from
    the run's start up to ``t``. None also when ``held`` has another shape (a cache policy's
    per-head subsets; a template that renders the stored text differently) or ``t`` comes before
    the run (the cache held another context when it was written): the caller falls back to the
    whole conversation.
    """
    n = min(len(held), len(conversation))
    p = next((i for i in range(n) if held[i] != conversation[i]), n)   # the common prefix
    if p == len(held) or p == 0:
        return None   # nothing dropped (or nothing in common): the conversation itself
    run = list(held[p:])
    first = run[0]
    for a in range(len(conversation) - len(run), p, -1):   # the newest match: rolling keeps the newest
        if conversation[a] == first and list(conversation[a:a + len(run)]) == run:
            return list(range(p)) + list(range(a, t)) if a <= t else None
    return None


def kept_share(session) -> torch.Tensor | None:
    """Under a cache policy, what each layer still holds of the conversation: ``(L, T)``
    float32 on the CPU, for each of the ``T`` tokens the share of the layer's KV heads that
    hold it (1: every head, 0: evicted by all; a sliding-window layer, never evicted by a
    policy: 1). None when nothing was evicted, or when the cache is not at the
    conversation's end (``T = len(context_ids(session))``)."""
    cache = getattr(session, "cache", None)
    if cache is None or not getattr(cache, "evicted", 0) or cache.length != len(context_ids(session)):
        return None
    out = torch.ones((cache.n_layers, cache.length))
    for i in cache.full_layers():
        out[i] = cache.held_mask(i)[0].float().mean(dim=0).cpu()
    return out


def token_strings(model: Model, ids: Sequence[int], cache: dict[int, str] | None = None) -> list[str]:
    """Each id decoded alone, special tokens kept (labels for the view). ``cache``: an
    id -> text dict reused across calls (decoding 8,000 ids one by one takes a while)."""
    cache = {} if cache is None else cache
    tok = model.tokenizer
    out = []
    for i in ids:
        s = cache.get(i)
        if s is None:
            s = cache[i] = tok.decode([i], skip_special_tokens=False)
        out.append(s)
    return out
