"""ggml's CPU matrix products on a GGUF's own blocks, through ``ggml-python``'s ctypes bindings.
Must not import Qt. Optional: without the ``ggml`` package (it comes as source and needs
cmake and a C compiler), :func:`available` says why once and the kernels table leaves
these out.

What a call is: ggml's ``mul_mat`` of one weight (its raw blocks, memory-mapped from the
file) and float32 activations, as a one-node graph built once per weight (a ``ggml_tensor``
whose data pointer is the weight's), computed on a persistent ggml threadpool. Per call
only the activations' and the output's pointers and row count are written into the
graph's structs. ggml quantizes the activations per block (to Q8_0, Q8_1 or Q8_K, the
type's ``vec_dot_type``), as llama.cpp does: relative error about 0.5 % against float64
on the default model's matrices (Intel Xeon), where the weights' own rounding is ~8 %.

Threads: each call uses ``torch.get_num_threads()`` threads, so the thread governors
steer ggml too. ggml-python builds ggml with OpenMP, and ggml's ``libggml-cpu.so`` asks
for ``libgomp.so.1``: in a process that imported torch first, that is torch's own copy
(one soname, loaded once), so ggml's parallel regions run on torch's OpenMP threads and
no second pool competes with them for the cores. The "threadpool" ggml's plan names is
then only per-thread state, made once instead of on every call.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_STATE: dict = {}  # "ggml": the module, "pool": threadpool, "threads": its size, "why": reason unavailable
_LOCK = threading.Lock()  # one compute at a time: the pool and the graphs' structs are shared


def available() -> bool:
    """Whether ggml's CPU kernels can run here (imported and initialised on first call; the
    reason it cannot is logged once and kept in :func:`unavailable_reason`)."""
    if "ggml" in _STATE:
        return True
    if "why" in _STATE:
        return False
    if os.environ.get("ATTNCHAT_GGML", "1") == "0":
        _STATE["why"] = "turned off (ATTNCHAT_GGML=0)"
        return False
    try:
        import ggml

        ggml.ggml_cpu_init()
    except (ImportError, OSError, RuntimeError, AttributeError) as e:
        _STATE["why"] = f"ggml-python is not installed or does not load ({type(e).__name__}: {e})"
        log.info("ggml kernels unavailable, torch's take their place: %s", _STATE["why"])
        return False
    _STATE["ggml"] = ggml
    return True


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    return _STATE.get("why")


def _pool(threads: int):
    """The persistent threadpool with at least ``threads`` threads (made again, bigger, when needed)."""
    g = _STATE["ggml"]
    if _STATE.get("threads", 0) < threads:
        old = _STATE.get("pool")
        params = g.ggml_threadpool_params_default(threads)
        params.poll = 0  # (without OpenMP: workers would sleep between graphs, not spin)
        _STATE["pool"] = g.ggml_threadpool_new(ctypes.byref(params))
        _STATE["threads"] = threads
        if old:
            g.ggml_threadpool_free(old)
    return _STATE["pool"]


#: The key a weight's repacked form (:mod:`runtime.kernels.ggml_repack`) is kept under in its
#: ``prepared``: here, where both that module and the kernels that multiply it read it.
REPACKED = "ggml-repack"

_WORK = {"buf": None}  # the shared work buffer (activations quantized per block), grown as needed


def _work(nbytes: int) -> int:
    buf = _WORK["buf"]
    if buf is None or buf.numel() < nbytes:
        with torch.inference_mode(False):
            buf = _WORK["buf"] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf.data_ptr()


class GGMLMatrix:
    """One weight as ggml's ``mul_mat`` operand: ``raw uint8 (rows, row bytes)`` of ``ggml_type``,
    or ggml's repacked form of those blocks (``form``: a :class:`runtime.kernels.ggml_repack.Repacked`,
    ``raw`` None).

    The caller keeps ``raw`` alive as long as this object (its memory is the graph's
    weight); a form is kept here. ``__call__(x float32 (M, cols)) -> float32 (M, rows)``.
    """

    #: Rows of activations the plan is sized for at first; more re-plan (a prefill chunk
    #: of 512 tokens is the usual maximum).
    PLANNED_ROWS = 512

    def __init__(self, raw: torch.Tensor | None, ggml_type: int, rows: int, cols: int, form=None):
        if not available():
            raise RuntimeError(f"ggml kernels unavailable: {unavailable_reason()}")
        self._g = _STATE["ggml"]
        self.rows, self.cols, self.ggml_type = rows, cols, ggml_type
        self._ctx = None
        self._build(raw, form)

    def _build(self, raw: torch.Tensor | None, form) -> None:
        g = self._g
        old = self._ctx
        self.raw, self.form = raw, form
        mem = g.ggml_tensor_overhead() * 4 + g.ggml_graph_overhead_custom(4, False) + 1024
        self._ctx = g.ggml_init(g.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if form is not None:   # its own tensor: ggml's compute finds the form through its buffer
            W = form.tensor
        else:
            W = g.ggml_new_tensor_2d(self._ctx, self.ggml_type, self.cols, self.rows)  # ggml order: row length first
            W.contents.data = raw.data_ptr()
        X = g.ggml_new_tensor_2d(self._ctx, g.GGML_TYPE_F32, self.cols, self.PLANNED_ROWS)
        Y = g.ggml_mul_mat(self._ctx, W, X)  # (rows, M) in ggml order: (M, rows) row-major
        self._graph = g.ggml_new_graph_custom(self._ctx, 4, False)
        g.ggml_build_forward_expand(self._graph, Y)
        self._x, self._y = X.contents, Y.contents
        self._planned = 0
        self._plan = None
        self._last: tuple | None = None  # (rows, threads, work buffer) the structs were set for
        self._compute = g.lib.ggml_graph_compute
        if old:
            g.ggml_free(old)

    def rebase(self, form) -> None:
        """Multiply ggml's repacked ``form`` of the same blocks from now on, and let go of
        ``raw`` (what :func:`runtime.kernels.ggml_repack.repacked` does before the blocks go).
        The caller holds :data:`_LOCK`."""
        self._build(None, form)

    def _plan_for(self, M: int, threads: int) -> None:
        g = self._g
        pool = _pool(threads)
        if self._plan is None or M > self._planned:
            self._set_rows(max(M, self.PLANNED_ROWS))
            plan = g.ggml_graph_plan(self._graph, _STATE["threads"], pool)
            self._plan, self._planned = plan, max(M, self.PLANNED_ROWS)
            self._work_size = plan.work_size + 64 * _STATE["threads"]
            self._planp = ctypes.byref(self._plan)
        self._plan.threadpool = pool
        self._plan.n_threads = threads
        self._plan.work_data = ctypes.cast(_work(self._work_size), ctypes.POINTER(ctypes.c_uint8))

    def _set_rows(self, M: int) -> None:
        for t in (self._x, self._y):
            t.ne[1] = M
            t.nb[2] = t.nb[1] * M
            t.nb[3] = t.nb[2]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x (M, cols)`` float32 contiguous -> ``(M, rows)`` float32 (into ``out`` if given)."""
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.rows, dtype=torch.float32)
        threads = max(1, torch.get_num_threads())
        with _LOCK:
            buf = _WORK["buf"]
            key = (M, threads, None if buf is None else buf.data_ptr())
            if key != self._last:  # the plan, the work buffer and the row counts change rarely
                self._plan_for(M, threads)
                self._set_rows(M)
                self._last = (M, threads, _WORK["buf"].data_ptr())
            self._x.data = x.data_ptr()
            self._y.data = out.data_ptr()
            status = self._compute(self._graph, self._planp)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")
        return out

    def __del__(self):
        ctx, g = getattr(self, "_ctx", None), getattr(self, "_g", None)
        if ctx and g is not None:
            try:
                g.ggml_free(ctx)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


_TO_FLOAT: dict[int, object] = {}
_TO_FLOAT_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def to_float(raw: torch.Tensor, ggml_type: int, out: torch.Tensor) -> torch.Tensor:
    """ggml's own dequantization (``type_traits.to_float``, one thread) of the contiguous blocks
    ``raw`` into the float32 ``out`` (as many weights as ``out`` holds); returns ``out``.
    Bitwise ``gguf.quants.dequantize`` (the tests check every type) and ~100x faster than
    decoding in torch on an Intel Xeon (1.2 ms against 104 for a 1536 x 576 Q4_1)."""
    fn = _TO_FLOAT.get(ggml_type)
    if fn is None:
        if not available():
            raise RuntimeError(f"ggml kernels unavailable: {unavailable_reason()}")
        traits = _STATE["ggml"].ggml_get_type_traits(ggml_type).contents
        address = ctypes.cast(traits.to_float, ctypes.c_void_p).value
        if not address:  # F32 has none
            raise ValueError(f"ggml has no to_float for type {ggml_type}")
        fn = _TO_FLOAT[ggml_type] = _TO_FLOAT_T(address)
    if not (raw.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32):
        raise ValueError("to_float takes contiguous blocks and a contiguous float32 output")
    fn(raw.data_ptr(), out.data_ptr(), out.numel())
    return out


_FROM_FLOAT: dict[int, tuple[object, int, int]] = {}  # vec_dot_type -> (fn, block weights, block bytes)
_FROM_FLOAT_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
Q8_0, Q8_1, Q8_K = 8, 9, 15


def vec_dot_type(ggml_type: int) -> int:
    """The type ggml quantizes activations to before a product with ``ggml_type`` weights
    (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K types)."""
    if not available():
        raise RuntimeError(f"ggml kernels unavailable: {unavailable_reason()}")
    return int(_STATE["ggml"].ggml_get_type_traits_cpu(ggml_type).contents.vec_dot_type)


def as_ggml_sees(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 ``x (M, K)`` as ggml's product with ``ggml_type`` weights sees it: quantized to the
    type's ``vec_dot_type`` by the same CPU function ``mul_mat`` calls, then decoded. ``x`` minus
    this is what that rounding loses (see ``runtime.kernels.quantized``'s ``ggml-exact``)."""
    vdt = vec_dot_type(ggml_type)
    entry = _FROM_FLOAT.get(vdt)
    if entry is None:
        traits = _STATE["ggml"].ggml_get_type_traits_cpu(vdt).contents
        base = _STATE["ggml"].ggml_get_type_traits(vdt).contents
        fn = _FROM_FLOAT_T(ctypes.cast(traits.from_float, ctypes.c_void_p).value)
        entry = _FROM_FLOAT[vdt] = (fn, int(base.blck_size), int(base.type_size))
    fn, block, nbytes = entry
    x = x.contiguous()
    n = x.numel()
    q = torch.empty(n // block * nbytes, dtype=torch.uint8)
    fn(x.data_ptr(), q.data_ptr(), n)
    blocks = q.view(-1, nbytes)
    if vdt in (Q8_0, Q8_1):  # d f16 (| s f16) | int8[32]
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        codes = blocks[:, nbytes - 32:].contiguous().view(torch.int8).float()
    elif vdt == Q8_K:  # d f32 | int8[256] | int16 bsums[16]
        d = blocks[:, 0:4].contiguous().view(torch.float32)
        codes = blocks[:, 4:260].contiguous().view(torch.int8).float()
    else:
        raise ValueError(f"activations of type {vdt} are not decoded here")
    return (codes * d).view_as(x)
