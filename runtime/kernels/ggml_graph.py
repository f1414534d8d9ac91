"""ggml graphs over torch memory: many of ggml's CPU operations computed in one call.

Must not import Qt. A :class:`Graph` holds two ggml contexts: one without memory of its own
for the tensors that live in torch (weights, norm weights, inputs: their data pointers are
the torch tensors'), and one with memory for the results of the graph's operations. A
result's memory is fixed once the graph is built, so :meth:`Graph.torch_view` gives a torch
tensor over it that stays valid, and is filled anew by every :meth:`Graph.compute`.

Why: one decoded token on a small model is hundreds of small operations (norms, RoPE, the
products, the activations, the residual adds). From Python each costs a dispatch (1-3 us in
torch, more as a ctypes call); ggml runs a whole graph of them in one call on one team of
threads (:mod:`runtime.kernels.ggml_ops` explains how its threads are torch's OpenMP ones).
The caller keeps every torch tensor it hands in alive as long as the graph.
"""
from __future__ import annotations

import ctypes

import torch

from runtime.kernels import ggml_ops

__all__ = ["Graph"]

_F32 = 0  # GGML_TYPE_F32


class Graph:
    """A ggml compute graph built once and computed many times.

    Args:
        result_bytes: memory for the operations' results (every result has its own: ggml
            does not reuse it within a plain context), plus ggml's bookkeeping.
        max_nodes: the graph's capacity in nodes.

    Raises:
        RuntimeError: ggml's kernels are unavailable (:func:`runtime.kernels.ggml_ops.available`).
    """

    def __init__(self, result_bytes: int, max_nodes: int = 256):
        if not ggml_ops.available():
            raise RuntimeError(f"ggml kernels unavailable: {ggml_ops.unavailable_reason()}")
        g = self.g = ggml_ops._STATE["ggml"]
        overhead = g.ggml_tensor_overhead()
        self._leaf_ctx = g.ggml_init(g.ggml_init_params(mem_size=overhead * max_nodes, mem_buffer=None, no_alloc=True))
        graph_bytes = g.ggml_graph_overhead_custom(max_nodes, False)
        self._ctx = g.ggml_init(g.ggml_init_params(
            mem_size=result_bytes + overhead * max_nodes * 2 + graph_bytes + 4096, mem_buffer=None, no_alloc=False))
        self._graph = g.ggml_new_graph_custom(self._ctx, max_nodes, False)
        self._max_nodes = max_nodes
        self._keep: list = []   # torch tensors and ctypes arrays whose memory the graph uses
        self._plan = None
        self._last: tuple | None = None
        self._compute = g.lib.ggml_graph_compute

    @property
    def ctx(self):
        """The context operations are made in (``ggml_add(graph.ctx, a, b)``)."""
        return self._ctx

    def leaf(self, t: torch.Tensor, shape: tuple[int, ...] | None = None, ggml_type: int = _F32):
        """A ggml tensor over ``t``'s memory (contiguous; float32 unless ``ggml_type`` says
        otherwise). ``shape`` is ggml's order (``ne0`` first, the fastest axis); default:
        ``t``'s shape reversed. A block type's row length in weights is ``ne0``."""
        if not t.is_contiguous():
            raise ValueError("a ggml leaf needs a contiguous tensor")
        g = self.g
        ne = tuple(reversed(t.shape)) if shape is None else shape
        ne = ne or (1,)
        make = {1: g.ggml_new_tensor_1d, 2: g.ggml_new_tensor_2d, 3: g.ggml_new_tensor_3d}[len(ne)]
        x = make(self._leaf_ctx, ggml_type, *ne)
        x.contents.data = t.data_ptr()
        self._keep.append(t)
        return x

    def keep(self, owner):
        """Keep ``owner`` (what holds memory a node of the graph reads) alive as long as the graph;
        returns it."""
        self._keep.append(owner)
        return owner

    def slot(self, ggml_type: int, ne: tuple[int, ...]):
        """A leaf without memory of its own (shape ``ne``, ggml's order): the caller points its
        ``data`` at memory it owns (and may reshape it, and views of it) before each
        :meth:`compute`. For buffers that move between computes, such as a KV cache that grows."""
        make = {1: self.g.ggml_new_tensor_1d, 2: self.g.ggml_new_tensor_2d, 3: self.g.ggml_new_tensor_3d}[len(ne)]
        return make(self._leaf_ctx, ggml_type, *ne)

    def output(self, node) -> None:
        """Make ``node`` (and everything it needs) part of the graph."""
        self.g.ggml_build_forward_expand(self._graph, node)

    def torch_view(self, node, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 torch tensor of ``shape`` over ``node``'s result memory (contiguous)."""
        n = 1
        for s in shape:
            n *= s
        if self.g.ggml_nbytes(node) < 4 * n or not self.g.ggml_is_contiguous(node):
            raise ValueError("a torch view needs a contiguous float32 result of at least its size")
        address = ctypes.cast(node.contents.data, ctypes.c_void_p).value
        buf = (ctypes.c_float * n).from_address(address)
        self._keep.append(buf)
        return torch.frombuffer(buf, dtype=torch.float32).view(shape)

    def compute(self) -> None:
        """Compute every node on ``torch.get_num_threads()`` threads (ggml's persistent pool).

        Raises:
            RuntimeError: ggml reports a failure.
        """
        g = self.g
        threads = max(1, torch.get_num_threads())
        with ggml_ops._LOCK:
            buf = ggml_ops._WORK["buf"]
            key = (threads, None if buf is None else buf.data_ptr())
            if key != self._last:
                pool = ggml_ops._pool(threads)
                if self._plan is None or self._plan_threads < threads:
                    self._plan = g.ggml_graph_plan(self._graph, ggml_ops._STATE["threads"], pool)
                    self._plan_threads = ggml_ops._STATE["threads"]
                    self._work_size = self._plan.work_size + 64 * self._plan_threads
                    self._planp = ctypes.byref(self._plan)
                self._plan.threadpool = pool
                self._plan.n_threads = threads
                self._plan.work_data = ctypes.cast(ggml_ops._work(self._work_size), ctypes.POINTER(ctypes.c_uint8))
                self._last = (threads, ggml_ops._WORK["buf"].data_ptr())
            status = self._compute(self._graph, self._planp)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self):
        g = getattr(self, "g", None)
        for name in ("_ctx", "_leaf_ctx"):
            ctx = getattr(self, name, None)
            if ctx and g is not None:
                try:
                    g.ggml_free(ctx)
                except Exception:  # noqa: BLE001 - interpreter shutdown
                    pass
