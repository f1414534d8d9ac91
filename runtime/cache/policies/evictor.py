"""Applying a cache policy to a KV cache: what the full-attention layers' queries saw, and
evicting down to the budget when the cache passes it.

Must not import Qt, the decoder or the generator (attached to a cache, :meth:`Evictor.observe`
is that cache's ``"queries"`` attention hook, :mod:`runtime.model.hooks`; the session, or the
cache-eval harness, calls :meth:`Evictor.evict`).

The budget is in tokens per full-attention layer (:func:`budget_for_bytes` turns MiB into
tokens). A reply's forward passes append to the cache; once it holds ``budget + step``
tokens or more, :meth:`Evictor.evict` keeps ``budget`` of them, so after a forward the cache
holds at most :attr:`Evictor.ceiling` = ``budget + step - 1``. A user's budget is a ceiling
(a MiB budget must never be passed): :meth:`Evictor.within` sets ``budget`` and ``step`` for
one (the policy's ``score()``
chooses which, :mod:`runtime.cache.policies`). Evicting after a forward, not before, lets a prompt's last chunk (the
question) choose what stays, as SnapKV does at the end of a prompt, and lets TOVA score
with the current token's attention; the price is that the cache briefly holds up to a
prefill chunk more than the budget. Evicting ``step`` or more tokens at once spreads the
cost of the gather (each eviction moves every kept slot of every layer).

What it observes, per full layer (only what the policy needs; nothing for ``sinks-window``
and ``key-norm``):

- ``snapkv`` / ``tova``: the newest ``W`` queries (rotated at their true positions) and
  those positions; their attention over the cache is computed when evicting (as kvpress
  recomputes it from the window's hidden states), masked so a query never sees a newer key.
- ``h2o``: after every forward, the attention of its queries over the cache (the same
  softmax as the model's, scale and soft-cap included), summed per slot: a ``(B, Hkv,
  capacity)`` float32 buffer per layer that moves with the slots when they are evicted.
  After a crop it keeps what the cropped queries added (an approximation: those are gone).
"""
from __future__ import annotations

import math

import torch

from models.kv_bytes import policy_tokens
from runtime.cache.policies import LayerObservation, PolicyParams, make_policy
from runtime.dtypes import cache_number_bytes

#: Tokens evicted at least per eviction (decode): see the module docstring.
DEFAULT_STEP = 16


class Evictor:
    """A cache policy with its budget, attached to one :class:`runtime.cache.kv_cache.KVCache`.

    Args:
        policy: one of :data:`runtime.cache.policies.CACHE_POLICIES` other than ``"none"``.
        budget: tokens each full-attention layer keeps after an eviction (at least 1).
        step: an eviction runs once the cache holds ``budget + step`` tokens (at least 1).
        params: the policies' knobs.

    Raises:
        ValueError: an unknown policy, ``"none"``, a budget or step below 1.
    """

    def __init__(self, policy: str, budget: int, *, step: int = DEFAULT_STEP, params: PolicyParams = PolicyParams()):
        self.scorer = make_policy(policy, params)  # raises for an unknown name
        if policy == "none":
            raise ValueError("the 'none' cache policy evicts nothing; do not attach an evictor")
        if budget < 1 or step < 1:
            raise ValueError(f"the cache budget and eviction step must be at least 1 token; got {budget}, {step}")
        self.policy, self.budget, self.step, self.params = policy, int(budget), int(step), params
        #: The most tokens a full layer holds after a forward (and its eviction): ``budget + step - 1``.
        self.ceiling = self.budget + self.step - 1
        self.window = self.scorer.queries
        self.accumulates = "accumulated" in self.scorer.needs
        self._q: dict[int, torch.Tensor] = {}  # layer -> (B, H, <=W, D) newest queries
        self._qpos: dict[int, torch.Tensor] = {}  # layer -> (<=W,) their positions
        self._acc: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, capacity) float32
        self._scale: dict[int, tuple[float, float | None]] = {}  # layer -> (scale, softcap)

    @classmethod
    def within(cls, policy: str, ceiling: int, *, step: int = DEFAULT_STEP,
               params: PolicyParams = PolicyParams()) -> "Evictor":
        """An evictor under which a full layer never holds more than ``ceiling`` tokens after a
        forward: it evicts once ``ceiling + 1`` are held, keeping ``ceiling - s + 1``, with ``s``
        the ``step`` but at most a quarter of the ceiling (at least 1), so a small budget is not
        emptied by a long step (a ceiling of 256: keeps 241, evicts at 257; of 4: keeps 4, evicts at 5).

        Raises:
            ValueError: as the constructor (a ceiling below 1).
        """
        if ceiling < 1:
            raise ValueError(f"the cache budget must be at least 1 token; got {ceiling}")
        s = max(1, min(int(step), int(ceiling) // 4))
        return cls(policy, int(ceiling) - s + 1, step=s, params=params)

    def attach(self, cache) -> "Evictor":
        """Observe ``cache``'s full layers from now on: registers :meth:`observe` as the cache's
        attention hook (``cache.evictor``, which the decoder's forward passes over ``cache`` add
        to their hooks); returns self."""
        cache.evictor = self
        self.cropped(cache)
        return self

    @staticmethod
    def detach(cache) -> None:
        """Stop observing ``cache`` (what it evicted stays evicted)."""
        cache.evictor = None

    # ---- observing -------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, cache, layer: int, q: torch.Tensor, keys: torch.Tensor, *,
                scale: float | None = None, softcap: float | None = None) -> None:
        """Record layer ``layer``'s new queries (called by the decoder's attention after
        :meth:`KVCache.update`, before :meth:`KVCache.advance`).

        Args:
            cache: the cache this evictor is attached to.
            layer: a full-attention layer.
            q: the new queries ``(B, H, T, D)``, rotated at positions ``length .. length + T - 1``.
            keys: the layer's keys after the update ``(B, Hkv, held + T, D)``.
            scale, softcap: the layer's attention scale (None: ``1/sqrt(D)``) and soft-cap.
        """
        T = q.shape[2]
        self._scale[layer] = (scale or 1.0 / math.sqrt(q.shape[-1]), softcap)
        qpos = torch.arange(cache.length, cache.length + T, device=q.device)
        if self.window:
            prev, prev_pos = self._q.get(layer), self._qpos.get(layer)
            if prev is not None:
                q, qpos_all = torch.cat([prev, q.float()], dim=2), torch.cat([prev_pos, qpos])
            else:
                q, qpos_all = q.float(), qpos
            self._q[layer], self._qpos[layer] = q[:, :, -self.window:].clone(), qpos_all[-self.window:].clone()
        if self.accumulates:
            w = self._attention(q[:, :, -T:], qpos, keys, cache.positions(layer, T), layer)  # (B, Hkv, G*T, Tk)
            received = w.sum(dim=2) / (q.shape[1] // keys.shape[1])  # (B, Hkv, Tk): summed over queries, mean over the group
            acc = self._grown(cache, layer, received.shape[-1])
            acc[:, :, : received.shape[-1]] += received

    def _attention(self, q: torch.Tensor, qpos: torch.Tensor, keys: torch.Tensor, kpos: torch.Tensor,
                   layer: int) -> torch.Tensor:
        """Weights ``(B, Hkv, G*Tq, Tk)`` of queries ``(B, H, Tq, D)`` at ``qpos (Tq,)`` over
        ``keys (B, Hkv, Tk, D)`` at ``kpos (B, Hkv, Tk)``: the model's softmax, causal by position.
        Row ``g*Tq + t`` is query head ``h*G + g``'s query ``t`` (heads grouped by their KV head)."""
        B, H, Tq, D = q.shape
        Hkv = keys.shape[1]
        G = H // Hkv
        scale, softcap = self._scale[layer]
        qg = q.float().reshape(B, Hkv, G * Tq, D)  # (B, Hkv, G Tq, D): a KV head's query heads side by side
        s = (qg @ keys.float().transpose(-2, -1)) * scale  # (B, Hkv, G Tq, Tk)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        seen = kpos.unsqueeze(2) <= qpos.repeat(G).view(1, 1, G * Tq, 1)  # (B, Hkv, G Tq, Tk)
        return torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)

    def _grown(self, cache, layer: int, n: int) -> torch.Tensor:
        acc = self._acc.get(layer)
        if acc is None or acc.shape[-1] < n:
            cap = max(n, cache.k[layer].shape[2])
            new = torch.zeros((cache.batch, cache.n_kv_heads, cap), dtype=torch.float32, device=cache.device)
            if acc is not None:
                held = cache.held(layer)
                new[:, :, :held] = acc[:, :, :held]
            acc = self._acc[layer] = new
        return acc

    # ---- evicting ----------------------------------------------------------------------------
    def due(self, cache) -> bool:
        """Whether the cache holds ``budget + step`` tokens or more."""
        return cache.held_tokens >= self.budget + self.step

    @torch.inference_mode()
    def evict(self, cache, *, force: bool = False) -> int:
        """Keep ``budget`` tokens in every full layer when :meth:`due` (or, with ``force``,
        whenever the cache holds more than the budget).

        Returns:
            tokens evicted from each full layer (0: nothing to do).
        """
        held = cache.held_tokens
        if held <= self.budget or not (force or self.due(cache)):
            return 0
        slots = {i: self.scorer.choose(self.observation(cache, i), self.budget) for i in cache.full_layers()}
        if not slots:
            return 0
        for i, acc in self._acc.items():
            idx = slots[i]
            acc[:, :, : self.budget] = acc[:, :, :held].gather(-1, idx)
        gone = cache.keep(slots)
        # A prompt's chunk grew the buffers past what decoding under this budget needs: give
        # that back, so "allocated" says what the policy holds (room kept for the next step's
        # forward, ``step`` tokens, so decoding does not grow and shrink them again).
        cache.shrink_to_fit(room=self.step, layers=list(slots))
        return gone

    def observation(self, cache, layer: int) -> "LayerObservation":
        """What the policy sees of layer ``layer`` now (:class:`runtime.cache.policies.LayerObservation`)."""
        held = cache.held(layer)
        pos = cache.positions(layer)
        needs = self.scorer.needs
        keys = cache.read_keys(layer) if "keys" in needs else None
        recent = acc = None
        if "recent_attention" in needs and layer in self._q:
            q = self._q[layer]
            kk = keys if keys is not None else cache.read_keys(layer)
            w = self._attention(q, self._qpos[layer], kk, pos, layer)  # (B, Hkv, G W, T)
            B, H, W, _ = q.shape
            recent = w.reshape(B, H, W, held)  # rows were grouped by KV head: (B, H, W, T)
        elif "recent_attention" in needs:  # nothing observed yet: every slot alike
            recent = torch.zeros((cache.batch, cache.n_kv_heads, 1, held), device=cache.device)
        if self.accumulates:
            acc = self._grown(cache, layer, held)[:, :, :held]
        return LayerObservation(positions=pos, keys=keys, recent_attention=recent, accumulated=acc)

    @torch.inference_mode()
    def cropped(self, cache) -> None:
        """The cache was cropped or reset: forget queries past its length."""
        for layer in list(self._qpos):
            keep = self._qpos[layer] < cache.length
            if not bool(keep.any()):
                del self._q[layer], self._qpos[layer]
            else:
                self._q[layer], self._qpos[layer] = self._q[layer][:, :, keep], self._qpos[layer][keep]
        if cache.length == 0:
            self._acc.clear()
        for layer, acc in self._acc.items():
            acc[:, :, cache.held(layer):] = 0  # slots past the crop are written again later


def budget_for_bytes(cache, limit_bytes: int) -> int:
    """The most tokens a policy may keep per full-attention layer for the cache to take at
    most ``limit_bytes``, sliding layers at their full window (the worst case;
    :func:`models.kv_bytes.policy_tokens`, which the memory planner uses too).

    Raises:
        ValueError: the sliding layers alone, or one token, pass ``limit_bytes``.
    """
    if not cache.full_layers():
        raise ValueError("this model has no full-attention layers: its sliding windows already bound the cache")
    elem, scale = cache_number_bytes(cache.dtype)
    tokens = policy_tokens(cache.windows, cache.n_kv_heads, cache.head_dim, elem, limit_bytes, scale, batch=cache.batch)
    if tokens < 1:
        sliding = sum(w * cache.layer_bytes_per_token(i) for i, w in enumerate(cache.windows) if w is not None)
        raise ValueError(f"{limit_bytes / 2**20:.1f} MiB does not hold one token besides the sliding windows "
                         f"({sliding / 2**20:.1f} MiB); raise the cache budget")
    return int(tokens)
