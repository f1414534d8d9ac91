"""ggml's repacked form of a weight's blocks: the rows interleaved for its faster CPU products.
Must not import Qt.

llama.cpp's CPU backend moves some weights into a buffer of type ``CPU_REPACK`` at load:
the blocks of 4 or 8 rows interleaved (``block_q4_Kx8`` and the like), so one pass of its
``gemv_*_8x8`` / ``gemm_*`` kernels computes 8 output rows from one read of the activations.
ggml-python's ``libggml-cpu`` carries the same kernels and buffer type; a weight allocated in
that buffer type gets them from plain ``mul_mat`` nodes (ggml's CPU compute asks the buffer's
traits first), in every graph :mod:`runtime.model.ggml_layers` builds.

Which weights get a form is ggml's choice, by block type, shape and this CPU's features
(``ggml_repack_get_optimal_repack_type``): on an AMD EPYC Zen 3 (AVX2, no AVX-512) Q4_0, Q4_K and
IQ4_NL do, Q6_K, Q8_0, Q5_K and Q2_K do not; :func:`repacked` asks per weight.
Measured there (``mul_mat`` of random blocks, 2 threads, best of 5, under load 3.7):
Q4_K 8192 x 2048, one row 20.4 -> 13.9 ms, 256 rows 389 -> 211 ms.

Not row-invariant: Q4_K's 4-row ``gemm`` rounds differently from its one-row ``gemv`` (Q4_0's
and IQ4_NL's forms gave equal rows at every count tried), and neither equals the plain
``mul_mat`` bit for bit (relative difference ~3e-7): the reproducible mode, which runs no ggml
graph, never sees these.

In place of the blocks, not beside them: a form is as many bytes as the blocks, in ggml's own
allocation (:attr:`Repacked.nbytes`, counted in the weight's ``extra_bytes``); once made,
the ggml products prepared on the blocks move to it and the blocks leave memory where the
file can give them again (``QuantWeight.drop_blocks``; ``resident_bytes`` then 0). What still
reads them (the ``widen`` prefill kernel, a widened matrix for the attribution view, a
repack made later) reads them from the file with ``pread`` (:mod:`runtime.weights.block_source`:
a file changed or cut short since the load gives :class:`runtime.errors.ModelFileChanged`,
never SIGBUS); the embedding and the LM head, which lookups read row by row, get no form.
Beside the blocks (+520 MiB on the 1B shape) the forms cost more memory than they gained
speed; in their place the 1B shape peaks at the plain blocks' memory.

Which types get forms by default is measured on each machine (:func:`measured_faster`): one
row (a decode step's) through matrices of the type in one graph, on their forms against their
plain blocks, kept in the cache folder. On an Intel Xeon with AVX-512 (family 6 model 167, 2 vCPUs) the
1B shape's Q4_K decode took 43 ms a token with forms against 58-61 without, level with
llama.cpp (same run, the bench: 23.9 against 23.9 tok/s at a depth of 128); on the AMD EPYC
Zen 3 the step was not measured faster (56-71 against 58-64 ms). ``ATTNCHAT_GGML_REPACK=1``
makes every form ggml has here, ``0`` none; ``ATTNCHAT_KERNELS=default`` (nothing measured)
none.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

from runtime.kernels import ggml_ops

__all__ = ["Repacked", "enabled", "measured_faster", "repacked", "time_forms"]

log = logging.getLogger(__name__)

#: The key a weight's form is kept under in its ``prepared`` (None kept too: no form here).
FORM = ggml_ops.REPACKED

_STATE: dict = {}   # "buft": the CPU_REPACK buffer type (0: none), "log": the log callback kept alive


#: How much faster a type's one-row products must run on its forms for them to be made by
#: default: beyond the timing's noise. A form costs no memory (it replaces the blocks).
MARGIN = 1.05
#: The matrices the choice times: rows, columns (a 1B model's square projection), and how many.
TIMED_SHAPE = (2048, 2048)
TIMED_MATRICES = 16


def enabled(type_name: str | None = None, ggml_type: int | None = None) -> bool:
    """Whether repacked forms are made for the block type ``type_name`` (ggml's id
    ``ggml_type``; None: for any type): ``ATTNCHAT_GGML_REPACK=1`` for every type ggml has a
    form of, ``0`` for none, unset where :func:`measured_faster` says so; and ggml loads, with
    a ``CPU_REPACK`` buffer type."""
    flag = os.environ.get("ATTNCHAT_GGML_REPACK", "")
    if flag == "0" or not ggml_ops.available() or not _buffer_type():
        return False
    if flag == "1":
        return True
    return type_name is not None and ggml_type is not None and measured_faster(type_name, ggml_type)


def measured_faster(type_name: str, ggml_type: int, folder=None) -> bool:
    """Whether this machine multiplies one row :data:`MARGIN` times faster on ``type_name``'s
    form than on its plain blocks (:func:`time_forms` on :data:`TIMED_SHAPE`): kept in
    ``folder`` (default: the cache folder) for the next load, under the rules of
    :func:`runtime.kernels.chooser.load_or_measure` (``ATTNCHAT_KERNELS=default`` and a busy
    machine: no forms, unmeasured). False where ggml has no form of the type here."""
    if folder is None:
        from runtime.kernels.chooser import machine_folder

        folder = machine_folder()
    return _measured(type_name, ggml_type, folder, os.environ.get("ATTNCHAT_KERNELS", ""))


@functools.lru_cache(maxsize=None)
def _measured(type_name: str, ggml_type: int, folder, mode: str) -> bool:
    """(``mode``: ``ATTNCHAT_KERNELS``, part of the key so that a change of it is obeyed.)"""
    from runtime.kernels.chooser import load_or_measure

    try:
        return load_or_measure(folder, _RepackChooser(type_name, ggml_type))
    except (RuntimeError, OSError, ValueError, MemoryError) as e:
        log.info("repacked forms of %s not measured (%s): none made", type_name, e)
        return False


def time_forms(ggml_type: int, reps: int = 5) -> dict[str, float] | None:
    """Microseconds of one row times :data:`TIMED_MATRICES` matrices of :data:`TIMED_SHAPE` of
    ``ggml_type`` in one ggml graph, as a decode step multiplies its projections (random
    weights quantized by ggml, a uniform importance matrix where ggml asks for one; more bytes
    than a core's L2 cache): on their plain blocks and on their forms (``{"blocks": us,
    "form": us}``, the fastest of ``reps`` computes after a warm-up), on
    ``torch.get_num_threads()`` threads. None: ggml has no form of the type here.

    One graph, not one call per matrix: a call's own cost (about 10-20 us) hid the forms'
    gain (on the Intel Xeon above, 16 calls of Q4_K 2048 x 2048: 0.8-0.9x; the same products
    in one graph 1.23-1.26x, and the 1B shape's step 1.4x).
    """
    import numpy as np
    import torch

    from runtime.kernels.chooser import best_time_us
    from runtime.kernels.ggml_graph import Graph

    g = ggml_ops._STATE["ggml"]
    rows, cols = TIMED_SHAPE
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.02
    raw = torch.empty(rows, g.ggml_row_size(ggml_type, cols), dtype=torch.uint8)
    floats = ctypes.POINTER(ctypes.c_float)
    imatrix = np.ones(cols, dtype=np.float32) if g.ggml_quantize_requires_imatrix(ggml_type) else None
    g.ggml_quantize_chunk(ggml_type, w.ctypes.data_as(floats), raw.data_ptr(), 0, rows, cols,
                          None if imatrix is None else imatrix.ctypes.data_as(floats))
    blocks = [raw.clone() for _ in range(TIMED_MATRICES)]
    with ggml_ops._LOCK:
        forms = [_make(b, ggml_type, rows, cols) for b in blocks]
    if forms[0] is None:
        return None
    x = torch.randn(1, cols)
    times = {}
    for name, operands in (("blocks", blocks), ("form", forms)):
        graph = Graph(result_bytes=TIMED_MATRICES * rows * 4 + (1 << 16), max_nodes=2 * TIMED_MATRICES + 8)
        X = graph.leaf(x, (cols, 1))
        for op in operands:
            W = op.tensor if name == "form" else graph.leaf(op, (cols, rows), ggml_type)
            graph.output(g.ggml_mul_mat(graph.ctx, W, X))
        graph.keep(operands)
        times[name] = best_time_us(graph.compute, reps, warm_up=True)
    return times


class _RepackChooser:
    """:class:`runtime.kernels.chooser.KernelChooser` of one block type's forms: kept under
    ``"repack"`` by type name in the machine's file."""

    what = "the repacked-forms choice"
    busy_runs_defaults = True
    measurable = True

    def __init__(self, type_name: str, ggml_type: int):
        self.type_name, self.ggml_type = type_name, ggml_type
        self.timings: dict | None = None

    def default(self) -> bool:
        return False

    def measure(self) -> bool:
        self.timings = time_forms(self.ggml_type)
        on = self.timings is not None and self.timings["form"] * MARGIN < self.timings["blocks"]
        log.info("repacked forms of %s: %s (one row x %d matrices of %d x %d, us: %s)", self.type_name,
                 "on" if on else "off", TIMED_MATRICES, *TIMED_SHAPE, self.timings)
        return on

    def from_kept(self, kept: dict) -> bool | None:
        entry = kept.get("repack", {}).get(self.type_name)
        return None if entry is None else bool(entry["on"])

    def keep(self, kept: dict, choice: bool) -> dict:
        kept.setdefault("repack", {})[self.type_name] = {"on": choice, "timings_us": self.timings}
        return kept


def _buffer_type() -> int:
    """The ``CPU_REPACK`` buffer type from the CPU backend's extra buffer types (0: none)."""
    if "buft" in _STATE:
        return _STATE["buft"]
    g = ggml_ops._STATE["ggml"]
    _STATE["buft"] = 0
    try:
        reg = g.ggml_backend_cpu_reg()
        dev = g.ggml_backend_reg_dev_get(reg, 0)
        fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not fn:
            return 0
        extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
        i = 0
        while extra and extra[i]:
            if g.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
                _STATE["buft"] = extra[i]
                break
            i += 1
    except (AttributeError, OSError, ValueError) as e:
        log.info("ggml's repacked forms unavailable: %s", e)
    if _STATE["buft"]:
        _quiet_ggml(g)
    return _STATE["buft"]


def _quiet_ggml(g) -> None:
    """ggml's log to Python's (warnings and errors only): its repack says a debug line on stderr
    for every weight it repacks."""
    def forward(level, text, _user):
        if level >= g.GGML_LOG_LEVEL_WARN and text:
            log.warning("ggml: %s", text.decode(errors="replace").rstrip())

    _STATE["log"] = g.ggml_log_callback(forward)
    g.ggml_log_set(_STATE["log"], None)


class Repacked:
    """One weight's blocks in ggml's ``CPU_REPACK`` buffer: :attr:`tensor` is the ``mul_mat``
    operand (``ne0`` = the row length in weights), :attr:`nbytes` its memory."""

    def __init__(self, g, ctx, tensor, buffer, nbytes: int, layout: str):
        self._g, self._ctx, self._buffer = g, ctx, buffer
        self.tensor, self.nbytes, self.layout = tensor, nbytes, layout

    def __del__(self):
        g = getattr(self, "_g", None)
        if g is None:
            return
        try:
            g.ggml_backend_buffer_free(self._buffer)
            g.ggml_free(self._ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _make(raw, ggml_type: int, rows: int, cols: int) -> Repacked | None:
    g = ggml_ops._STATE["ggml"]
    buft = _buffer_type()
    ctx = g.ggml_init(g.ggml_init_params(mem_size=g.ggml_tensor_overhead() * 2, mem_buffer=None, no_alloc=True))
    W = g.ggml_new_tensor_2d(ctx, ggml_type, cols, rows)
    if g.ggml_nbytes(W) != raw.numel():
        g.ggml_free(ctx)
        raise ValueError(f"blocks of {rows} x {cols} (type {ggml_type}) do not match ggml's size")
    size = g.ggml_backend_buft_get_alloc_size(buft, W)
    buffer = g.ggml_backend_buft_alloc_buffer(buft, size)
    if not buffer:
        g.ggml_free(ctx)
        raise MemoryError(f"ggml could not allocate {size:,} bytes for a repacked weight")
    g.ggml_backend_tensor_alloc(buffer, W, g.ggml_backend_buffer_get_base(buffer))
    if not W.contents.extra:   # ggml has no form for this type and shape on this CPU
        g.ggml_backend_buffer_free(buffer)
        g.ggml_free(ctx)
        return None
    blocks = raw if raw.is_contiguous() else raw.contiguous()
    g.ggml_backend_tensor_set(W, ctypes.c_void_p(blocks.data_ptr()), 0, blocks.numel())
    return Repacked(g, ctx, W, buffer, int(size), f"type {ggml_type}")


def repacked(w) -> Repacked | None:
    """``w``'s repacked form (a :class:`runtime.weights.quant_weight.QuantWeight` on the CPU:
    ``raw``, ``btype.ggml_type``, ``rows``, ``cols``, ``prepared``), made once and kept in
    ``w.prepared``; None where ggml has none for it here or the forms are off (:func:`enabled`).

    The form replaces the blocks: ggml products already prepared on them (``GGMLMatrix``)
    move to the form, and the blocks go from memory where the file can give them again
    (``w.drop_blocks()``; later readers read them from the file: ``w.blocks``). A weight
    without a file keeps its blocks beside the form.

    Raises:
        ValueError: the blocks do not hold the shape; MemoryError: ggml's allocation failed.
    """
    from runtime.kernels.quantized import _cpu_branch

    if FORM in w.prepared:   # made (its blocks may be gone): the form, whatever the setting says now
        return w.prepared[FORM]
    if not enabled(w.btype.name, w.btype.ggml_type):
        return None
    if not w.btype.quantized or not _cpu_branch(w.raw):   # a device's blocks: ggml has no form there
        return None
    with ggml_ops._LOCK:
        form = w.prepared[FORM] = _make(w.raw, w.btype.ggml_type, w.rows, w.cols)
        if form is not None:
            _replace_blocks(w, form)
    return form


def _replace_blocks(w, form: Repacked) -> None:
    """Point every ggml product prepared on ``w``'s blocks at ``form``, then let the blocks go
    (the C heap's free pages handed back: the blocks were read at load in pieces it keeps)."""
    from runtime.device import trim_heap

    for k in list(w.prepared.values()):
        if isinstance(k, ggml_ops.GGMLMatrix) and k.form is None:
            k.rebase(form)
    if w.drop_blocks():
        trim_heap()
