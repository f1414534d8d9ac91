"""The attention hooks list: the Python that runs inside attention, per layer.

Must not import Qt, the generator or the cache policies.

A hook is what a CUDA graph or a compiled step cannot capture, so one list holds them all and
the static decode step asks one question of it (:meth:`AttentionHooks.for_cache` empty or
not). Three kinds (:class:`Hook`), called in this order in a layer:

- ``"queries"``: ``fn(cache, layer, q, keys, *, scale, softcap)`` after the cache's update, in
  full-attention layers only: a cache policy's evictor
  (:class:`runtime.cache.policies.evictor.Evictor`) registers itself on the cache it is
  attached to (``cache.evictor``), so it joins the list for that cache's forward passes only.
- ``"weights"``: ``fn(layer, weights)`` with the attention weights over positions
  ``(B, H, Tq, Tk)`` float32, or the newest query's row ``(B, H, 1, Tk)`` when ``last_row_only``
  (attention then keeps its fast path for the output): the attention capture
  (:attr:`runtime.model.decoder.Decoder.observer`).
- ``"heads"``: ``y = fn(layer, y)`` on the heads' outputs ``(B, H, T, D)`` before the output
  projection, in ``layer`` only: a head knock-out
  (:attr:`runtime.model.attention.Attention.head_edit`).

With nothing registered a layer pays one truth test of an empty tuple.

A registered hook belongs to the thread that registered it: only forward passes on that
thread run it (and :meth:`AttentionHooks.find` finds it there only). One model may serve
several threads at once (the desktop's chat on its worker thread, the in-process HTTP
server's engine on its own): the chat's attention capture or head knock-out must not run
inside a server request's pass (it would record the request's rows as the chat's, knock
out heads in its reply, and keep its step off the static path).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

HOOK_KINDS = ("queries", "weights", "heads")


@dataclass(frozen=True)
class Hook:
    """One entry of the list: its kind (:data:`HOOK_KINDS`), the callable, the layer it is
    for (``"heads"`` only; None: every layer), for ``"weights"``, whether only the
    newest query's row is wanted, and the thread whose passes run it (``threading.get_ident()``;
    the registering thread by default; None: every thread)."""

    kind: str
    fn: Callable
    layer: int | None = None
    last_row_only: bool = False
    thread: int | None = field(default_factory=threading.get_ident)

    def __post_init__(self) -> None:
        if self.kind not in HOOK_KINDS:
            raise ValueError(f"unknown attention hook kind {self.kind!r}; use one of {', '.join(HOOK_KINDS)}")


class AttentionHooks:
    """The decoder's hooks, shared by every attention layer (model-wide: the capture, head
    edits), plus each cache's evictor for that cache's passes (:meth:`for_cache`)."""

    def __init__(self) -> None:
        #: The registered hooks in order, a tuple: read per forward pass, rebuilt per change.
        self.active: tuple[Hook, ...] = ()

    def add(self, hook: Hook) -> Hook:
        """Register ``hook`` (last in order); returns it, the handle :meth:`remove` takes."""
        self.active = (*self.active, hook)
        return hook

    def remove(self, hook: Hook) -> None:
        """Unregister ``hook`` (nothing when it is not registered)."""
        self.active = tuple(h for h in self.active if h is not hook)

    def here(self) -> tuple[Hook, ...]:
        """The registered hooks this thread's passes run (its own and those of every thread)."""
        active = self.active
        if not active:
            return active
        me = threading.get_ident()
        return tuple(h for h in active if h.thread is None or h.thread == me)

    def find(self, kind: str, layer: int | None = None) -> Hook | None:
        """The first hook of ``kind`` for ``layer`` this thread runs (:meth:`here`), or None."""
        return next((h for h in self.here() if h.kind == kind and h.layer == layer), None)

    def replace(self, kind: str, fn: Callable | None, layer: int | None = None, **kw) -> None:
        """Set the one hook of ``kind`` for ``layer`` to ``fn`` (None: remove it)."""
        old = self.find(kind, layer)
        if old is not None:
            self.remove(old)
        if fn is not None:
            self.add(Hook(kind, fn, layer, **kw))

    def for_cache(self, cache) -> tuple[Hook, ...]:
        """The hooks of one forward pass over ``cache`` (None: no cache): the registered
        ones and the cache's evictor's queries hook. Empty: the pass needs no Python per
        layer (the static decode step may run)."""
        evictor = None if cache is None else cache.evictor
        if evictor is None:
            return self.here()
        return (*self.here(), Hook("queries", evictor.observe, thread=None))


def run_hooked(hooks: tuple[Hook, ...], layer: int, cache, q: torch.Tensor, keys: torch.Tensor, *,
               attend: Callable[[], torch.Tensor],
               formula: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
               exact: bool, scale: float | None, softcap: float | None) -> torch.Tensor:
    """One attention layer's output ``(B, H, T, D)`` with ``hooks`` run around it, in the
    order of the module docstring.

    Args:
        hooks: the pass's hooks (:meth:`AttentionHooks.for_cache`), not empty.
        layer, cache: the layer and the pass's cache (None: no cache).
        q, keys: the new queries ``(B, H, T, D)`` and the layer's keys after the update
            ``(B, Hkv, Tk, D)``.
        attend: the layer's own attention (the fast path, or the reproducible one).
        formula: the reference formula for some query rows ``(B, H, t, D)``: (output, weights
            ``(B, H, t, Tk)``).
        exact: the output must come from ``attend`` even when the formula ran on every row
            (the reproducible mode's bits).
        scale, softcap: the layer's, for the ``"queries"`` hooks.
    """
    if cache is not None and cache.windows[layer] is None:  # a cache policy observes full layers only
        for h in hooks:
            if h.kind == "queries":
                h.fn(cache, layer, q, keys, scale=scale, softcap=softcap)
    seen = [h for h in hooks if h.kind == "weights"]
    if not seen:
        y = attend()
    elif all(h.last_row_only for h in seen):
        # Only the newest query's weights are wanted (the live view): the fast path for
        # the output, the formula for one row (it sees every key: no mask).
        y = attend()
        _, weights = formula(q[:, :, -1:])  # (B, H, 1, Tk)
    else:
        y, weights = formula(q)
        if exact:
            y = attend()
    if seen:
        # over slots -> over positions 0 .. length + T - 1 (keys a sliding layer dropped or a policy evicted: weight 0)
        weights = weights if cache is None else cache.spread(layer, weights, q.shape[2])
        for h in seen:
            h.fn(layer, weights[:, :, -1:] if h.last_row_only else weights)
    return edit_heads(hooks, layer, y)


def edit_heads(hooks: tuple[Hook, ...], layer: int, y: torch.Tensor) -> torch.Tensor:
    """``y (B, H, T, D)`` through the ``"heads"`` hooks registered for ``layer``, in order."""
    for h in hooks:
        if h.kind == "heads" and h.layer == layer:
            y = h.fn(layer, y)
    return y
