"""The decode step: one new token, run eagerly, at static shapes, as a CUDA graph, or compiled.

Must not import Qt.

Eager decode (:meth:`runtime.model.decoder.Decoder.forward` with a cache) slices the cache to
its length, so every step has a new key length. That is fine on the CPU, but on a GPU
a step is ~740 small kernels launched from Python (about 7 us each on an H200, against
~1.8 ms of GPU work) and a new shape each time cannot be captured. The static step
(:meth:`runtime.model.decoder.Decoder.forward` with ``input_pos``) has the same shapes at every position
within a capacity bucket of the KV cache: the position is a device tensor, the new key
and value are written with ``index_copy_``, and attention reads the whole buffer with
a mask row. The modes (:data:`DECODE_MODES`):

- ``"eager"``: :meth:`Decoder.forward`, the readable reference (and the only mode that
  serves the attention capture: an observer or a hook is Python, called per layer).
- ``"static"``: the static step run as it is (what the graph records; tests check it
  equals the reference on the CPU).
- ``"graph"``: the static step captured once per capacity bucket as a CUDA graph
  (``torch.cuda.CUDAGraph``) and replayed: one launch per token (CUDA only).
- ``"compile"``: the static step through ``torch.compile`` (inductor fuses the norms,
  RoPE and activations; CPU and CUDA).
- ``"ggml"``: a GGUF's blocks on the CPU as ggml graphs (:mod:`runtime.model.ggml_step`): the
  whole token as one graph, its attention and KV cache writes included, for a float cache;
  a graph per layer with our attention and cache writes between them for any other.

Every mode writes the same cache and returns the same logits (to rounding): a session
can change modes between tokens, and falls back to ``"eager"`` whenever the step
would need Python per layer.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from runtime.cache.kv_cache import KVCache

log = logging.getLogger(__name__)

DECODE_MODES = ("eager", "static", "graph", "compile", "ggml")
#: The environment variable naming inductor's on-disk cache (torch's own).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_inductor_cache() -> str:
    """Point inductor's on-disk cache (compiled graphs, AOT and FX graph caches) at
    ``<attnchat cache>/inductor/<machine key>`` unless ``TORCHINDUCTOR_CACHE_DIR`` names
    one already; returns the folder in use.

    torch's default is a folder under ``/tmp``, which a reboot empties, and a compiled
    decode step takes minutes to build on a CPU. The machine key
    (:func:`runtime.kernels.machine.machine_key`: CPU model and flags, torch version, threads)
    keeps another machine's or torch's artifacts apart; the model's shape is in inductor's
    own keys. Falls back to torch's default when the app's cache folder cannot be made.
    """
    import os

    from runtime.kernels.machine import machine_key

    if os.environ.get(INDUCTOR_CACHE_ENV):
        return os.environ[INDUCTOR_CACHE_ENV]
    try:
        from models import paths

        folder = paths.cache_dir() / "inductor" / machine_key()
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[INDUCTOR_CACHE_ENV] = str(folder)
    except OSError:
        log.warning("no app cache folder for compiled code; using torch's default", exc_info=True)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


class DecodeStep:
    """Decodes one token into a KV cache in the chosen mode.

    Args:
        decoder: a :class:`runtime.model.decoder.Decoder` with weights loaded.
        mode: one of :data:`DECODE_MODES`.
        warmup: runs of the static step before a CUDA graph is captured (kernels pick
            their algorithms and allocate workspaces outside the capture).
        max_graphs: captured graphs kept, most recently used first: one per KV cache
            and capacity bucket, so the server's pooled conversations do not re-capture
            each time they take turns.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, decoder, mode: str = "eager", *, warmup: int = 2, max_graphs: int = 4):
        if mode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {mode!r}; use one of {', '.join(DECODE_MODES)}")
        self.decoder = decoder
        self.mode = mode
        self.warmup = warmup
        self._token: torch.Tensor | None = None  # (1, 1) int64 on the device: the step's input
        self._pos: torch.Tensor | None = None  # (1,) int64 on the device
        self.max_graphs = max_graphs
        # (capacity, dtype, every buffer's address) -> (graph, its output buffer)
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._compiled = None
        self._marked: tuple[int, int] | None = None  # (cache, capacity) whose buffers were marked dynamic
        #: ``"compile"`` mode: ``"none"`` (not compiled yet), ``"compiling"`` (in the background,
        #: :meth:`prepare`; tokens decode eagerly meanwhile), ``"ready"``, ``"failed"`` (no C++
        #: compiler, an inductor error: eager from then on, said once in the log).
        self.compile_state = "none"
        self.compile_seconds: float | None = None  # how long the first compiled step took
        self._prepared = threading.Event()
        self._ggml = None  # ``"ggml"`` mode: the per-layer graphs, built on the first token
        self._ggml_lock = threading.Lock()  # the graphs' buffers serve one token at a time
        self.captures = 0  # CUDA graphs captured so far (one per capacity bucket)

    def _inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._token is None or self._token.device != device:
            with torch.inference_mode(False):  # normal tensors: the compiled step runs outside inference mode
                self._token = torch.zeros((1, 1), dtype=torch.long, device=device)
                self._pos = torch.zeros((1,), dtype=torch.long, device=device)
        return self._token, self._pos

    @torch.inference_mode()
    def __call__(self, token: int | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of ``token`` at position ``cache.length``, appended to ``cache``.

        Args:
            token: the token id (an int, or a 0-d / ``(1,)`` / ``(1, 1)`` int64 tensor on
                the model's device: it is copied there without a host round trip).
            cache: the conversation's KV cache (batch 1).

        Returns:
            float32 logits ``(1, 1, V)`` on the model's device. In ``"graph"`` mode this is
            the graph's output buffer: valid until the next call.

        Raises:
            CacheLimitError: the cache cannot take one more token.
            ValueError: a position past the model's maximum context.
        """
        decoder = self.decoder
        if self.mode == "ggml":
            step = self._ggml_step()
            if step is not None and step.ready(cache):
                ids = token.reshape(1, 1) if isinstance(token, torch.Tensor) else torch.tensor([[token]])
                with self._ggml_lock:
                    return step(ids, cache)
        if not self.static_ok(cache) or (self.mode == "compile" and self.compile_state in ("compiling", "failed")):
            # Python per layer (an attention hook: the capture, a head knock-out, a cache
            # policy's evictor): a graph or a compiled step would bake in what it saw at
            # capture time. Sliding-window layers (a bounded buffer that moves), quantized
            # caches and length-dependent RoPE (longrope) take the eager path.
            ids = token.reshape(1, 1) if isinstance(token, torch.Tensor) else torch.tensor([[token]], device=cache.device)
            return decoder(ids, cache, last_only=True)
        if cache.length + 1 > decoder.cfg.max_position_embeddings:
            raise ValueError(
                f"{cache.length + 1} tokens pass the model's maximum context of {decoder.cfg.max_position_embeddings}"
            )
        cache.reserve(1)
        tok, pos = self._inputs(cache.device)
        if isinstance(token, torch.Tensor):
            tok.copy_(token.reshape(1, 1))
        else:
            tok.fill_(int(token))
        pos.fill_(cache.length)
        if self.mode == "graph":
            out = self._replay(tok, pos, cache)
        elif self.mode == "compile":
            out = self._run_compiled(tok, pos, cache, first=self.compile_state == "none")
            if out is None:  # it could not compile: this token eagerly (the slot is reserved)
                return decoder(tok.clone(), cache, last_only=True)
        else:
            out = decoder(tok, cache, input_pos=pos)
        cache.advance(1)
        return out

    def _run_compiled(self, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache, *, first: bool) -> torch.Tensor | None:
        """The compiled static step (``first``: the call that compiles it); None when
        compiling failed (:attr:`compile_state` then says ``"failed"``)."""
        if self._compiled is None:
            use_inductor_cache()
            from runtime.kernels.onednn import register_compiled_op

            register_compiled_op()  # the traced step calls oneDNN only when probed before
            self._compiled = torch.compile(self.decoder.forward, fullgraph=True)
        if self._marked != (id(cache), cache.capacity):
            # One graph for every capacity: the buffers' token axis is symbolic (else a
            # grown cache compiles a second, dynamic graph: minutes on a CPU).
            for t in (*cache.k, *cache.v):
                torch._dynamo.maybe_mark_dynamic(t, 2)
            self._marked = (id(cache), cache.capacity)
        t0 = time.perf_counter()
        try:
            # Outside inference mode (no gradients all the same): compiled code cannot
            # take views of the tensors it writes while inference mode is on.
            with torch.inference_mode(False), torch.no_grad():
                out = self._compiled(tok, cache, input_pos=pos)
        except Exception as e:  # noqa: BLE001 - no C++ compiler, an inductor or dynamo error
            if not first:
                raise
            self.compile_state = "failed"
            log.warning("the compiled decode step failed to build (%s: %s); decoding eagerly",
                        type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
            return None
        if first:
            self.compile_seconds = time.perf_counter() - t0
            self.compile_state = "ready"
            log.info("compiled the decode step in %.1f s (inductor cache %s)", self.compile_seconds, use_inductor_cache())
        return out

    def prepare(self, cache: KVCache, *, background: bool = True) -> threading.Event:
        """Compile the step before the first token (``"compile"`` mode; other modes: nothing
        to do), decoding one token into ``cache``, a scratch cache the caller then drops.

        With ``background``, a thread compiles while :meth:`__call__` decodes eagerly;
        :attr:`compile_state` says where it stands. Minutes the first time on a machine,
        much less once inductor's on-disk cache holds the step (:func:`use_inductor_cache`).

        Returns:
            an event set when the compiled step is ready or has failed.
        """
        if self.mode != "compile" or self.compile_state != "none" or not self.static_ok(cache):
            self._prepared.set()
            return self._prepared
        self.compile_state = "compiling"

        def run() -> None:
            try:
                with torch.inference_mode():
                    cache.reserve(1)
                with torch.inference_mode(False):  # inputs of its own: the caller's may be in use
                    tok = torch.zeros((1, 1), dtype=torch.long, device=cache.device)
                    pos = torch.full((1,), cache.length, dtype=torch.long, device=cache.device)
                self._run_compiled(tok, pos, cache, first=True)
            except Exception:  # noqa: BLE001 - whatever it was, decoding goes on eagerly
                self.compile_state = "failed"
                log.warning("preparing the compiled decode step failed; decoding eagerly", exc_info=True)
            finally:
                self._prepared.set()

        if background:
            threading.Thread(target=run, name="attnchat-compile-decode", daemon=True).start()
        else:
            run()
        return self._prepared

    def _ggml_step(self):
        """The per-layer ggml graphs of ``"ggml"`` mode (built once; None, said once in the
        log, when this decoder cannot take them: every token then decodes eagerly)."""
        if self._ggml is None:
            from runtime.model.ggml_step import GGMLStep
            from runtime.model.quant_layers import ggml_step_unsupported

            why = ggml_step_unsupported(self.decoder)
            if why:
                log.warning("the ggml decode step does not take this model (%s); decoding eagerly", why)
                self._ggml = False
            else:
                self._ggml = GGMLStep(self.decoder)
        return self._ggml or None

    def static_ok(self, cache: KVCache) -> bool:
        """Whether this step may run at static shapes on ``cache`` (else it runs eagerly):
        not the eager or ggml mode, and :meth:`runtime.model.decoder.Decoder.static_ok` (no
        attention hook, fixed slots, no length-dependent RoPE)."""
        return self.mode not in ("eager", "ggml") and self.decoder.static_ok(cache)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _replay(self, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Replay the graph of this cache's buffers, capturing it first when they are new
        (another conversation, or a new capacity bucket, which reallocates them)."""
        key = (cache.capacity, cache.dtype, tuple(t.data_ptr() for t in cache.k), tuple(t.data_ptr() for t in cache.v))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(tok, pos, cache)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> tuple:
        """Warm up on a side stream, then capture the static step (CUDA only).

        The warm-up runs write this token's keys and values at ``pos``: the same values
        the replay writes right after, so they change nothing.
        """
        decoder = self.decoder
        stream = torch.cuda.Stream(device=cache.device)
        stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                decoder(tok, cache, input_pos=pos)
        torch.cuda.current_stream(cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # A private memory pool per graph (a step's activations: a few MB): graphs that
        # share a pool may overwrite each other's outputs when replayed out of order.
        with torch.cuda.graph(graph):
            out = decoder(tok, cache, input_pos=pos)
        self.captures += 1
        log.info("captured a CUDA graph for a %d-token KV cache", cache.capacity)
        return graph, out

    def reset(self) -> None:
        """Drop captured graphs and compiled code (after the weights or kernels change)."""
        self._graphs.clear()
        self._compiled = None
        self._marked = None
