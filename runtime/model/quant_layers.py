"""The decoder's linear layers and embedding on a GGUF's own blocks.
Must not import Qt.

:class:`QuantLinear` holds a matrix as parts in their file's blocks
(:class:`runtime.weights.quant_weight.QuantWeight`, stacked along the output rows: a
layer's q/k/v when their types differ) and runs each part with the kernel chosen for
its block type and the phase (:class:`runtime.kernels.quant_choice.QuantChoice`): one new
token per sequence is decode (one row, or ``(B, 1, in)``: a batch of sequences decoding
together, each row with the numbers it gets alone, as ggml's product is row-invariant and
the prefill kernel need not be), several tokens of a sequence prefill. :class:`QuantEmbedding` widens only the rows a token
needs. Inside ``torch.compile`` both call opaque ops (ggml's kernels are ctypes calls);
with gradients (the attribution view) a product uses the dequantized matrix, so autograd
sees an ordinary linear layer.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.device import on_cpu
from runtime.kernels import ggml_ops
from runtime.kernels import quant_choice as qc
from runtime.kernels import quantized as qk
from runtime.model.prefill_forms import PrefillForms

__all__ = ["QuantLinear", "QuantEmbedding", "install", "make_forms", "quant_layers", "set_choice", "token_weights",
           "ggml_step_unsupported", "widened_for_gradients"]


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in GGUF blocks: ``x (..., in)`` any float dtype ->
    ``(..., out)`` in ``x``'s dtype (the kernels compute in float32, or bfloat16 for int4pack).

    Attributes:
        parts: the matrix's parts, top to bottom (``out`` = their rows summed).
        bias: float ``(out,)`` or None.
        choice: the kernels (:meth:`set_choice`); until set, the defaults for the CPU.
    """

    def __init__(self, parts: list, bias: torch.Tensor | None = None):
        super().__init__()
        if not parts or any(p.cols != parts[0].cols for p in parts):
            raise ValueError("a QuantLinear needs parts with one row length")
        self.parts = list(parts)
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.choice: qc.QuantChoice | None = None
        self.device = torch.device("cpu")
        self._runs: tuple[list, list] = ([], [])  # per part: (kernel run, form, weight), decode then prefill
        self._short: list[tuple[int, tuple | None]] = []   # per part: (most rows, run) of a short prefill
        self._short_max = 0
        self._keys: list[int] = []
        # Inside widened_for_gradients: the matrix widened once, kept for every gradient pass.
        self.keep_widened = False
        self._widened: torch.Tensor | None = None

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.btype.name} {p.rows}x{p.cols}" for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, parts=[{kinds}], bias={self.bias is not None}"

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in memory (none for a part a repacked form replaced) and of the forms
        the chosen kernels made (tied parts counted here too)."""
        return sum(p.resident_bytes + p.extra_bytes for p in self.parts) + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def set_choice(self, choice: qc.QuantChoice, device: torch.device | str = "cpu",
                   forms: PrefillForms | None = None) -> None:
        """Run the parts with ``choice``'s kernels on ``device``; each kernel's form of each
        part is made now (a repack, or ggml's graph), not on the first token. With ``forms``,
        a prefill form not made yet is left to it (:mod:`runtime.model.prefill_forms`): until
        it is built, prefill runs the part's copy-free default kernel."""
        self.choice, self.device = choice, torch.device(device)
        decode_runs, prefill_runs, deferred = [], [], []
        for i, p in enumerate(self.parts):
            decode, prefill = choice.kernels[p.btype.name]
            decode_runs.append(self._run(p, decode))
            fallback = None   # a kernel that reads the blocks themselves (a cheap form, if any) runs at once
            if forms is not None and prefill not in qc.COPY_FREE and prefill not in p.prepared:
                fallback = _copy_free_default(p, self.device)
            if fallback is None or fallback == prefill:
                prefill_runs.append(self._run(p, prefill))
            else:
                forms.add(p, prefill)
                prefill_runs.append(self._run(p, fallback))
                deferred.append((i, p, prefill))
        self._runs = (decode_runs, prefill_runs)
        self._short = [(n, self._run(p, qc.SHORT_KERNEL) if n > 1 else None)
                       for p in self.parts for n in [choice.short_rows.get(p.btype.name, 0)]]
        self._short_max = max(n for n, _ in self._short)
        self._keys = [qk.weight_key(p) for p in self.parts]
        qk.compiled_linear()  # defined now: torch.compile cannot define an op while tracing
        if deferred:
            forms.on_ready(functools.partial(self._switch, self._runs, deferred))

    def _switch(self, runs: tuple[list, list], deferred: list) -> None:
        """Prefill with the forms ``deferred`` named, made now; unless another choice was set since."""
        if self._runs is not runs:
            return
        prefill = list(runs[1])
        for i, p, name in deferred:
            prefill[i] = self._run(p, name)
        self._runs = (runs[0], prefill)   # one assignment: a product running now reads either list

    def _run(self, p, name: str) -> tuple:
        return qk.QUANT_KERNELS[name].run, qk.prepared(p, name, self.device), p, name

    def _ensure_choice(self) -> None:
        if self.choice is None:
            self.set_choice(qc.default_quant_choice({p.btype for p in self.parts}, self.device), self.device)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix ``(out, in)`` widened to ``dtype`` (a fresh tensor: for views that
        need the numbers, such as gradients, not for products). Each part is widened into its
        rows of one buffer: no second copy at the peak (Gemma 3's head is 671 MB in float32)."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        row = 0
        for p in self.parts:
            qk.widen(p, torch.float32, out=out[row:row + p.rows])
            row += p.rows
        return (out if dtype == torch.float32 else out.to(dtype)).to(self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # attribution: an ordinary linear layer to autograd
            if not self.keep_widened:
                w = self.dequantized(x.dtype)
            else:   # widened once for many gradient passes (widened_for_gradients)
                if self._widened is None or self._widened.dtype != x.dtype:
                    self._widened = self.dequantized(x.dtype)
                w = self._widened
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        self._ensure_choice()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        # one token per sequence (B, 1, in) decodes as one row does: a batched reply equals it alone
        phase = 0 if x2.shape[0] == 1 or (x.dim() >= 3 and shape[-2] == 1) else 1
        runs = self._runs[phase]
        if phase and x2.shape[0] <= self._short_max:   # a short prefill: see quant_choice.SHORT_KERNEL
            runs = [s if s is not None and x2.shape[0] <= n else r for r, (n, s) in zip(runs, self._short)]
        if torch.compiler.is_compiling():
            op = qk.compiled_linear()
            outs = [op(x2, key, run[3]) for key, run in zip(self._keys, runs)]
        else:
            xf = x2 if x2.dtype == torch.float32 else x2.float()
            outs = [run(xf, form, p) for run, form, p, _ in runs]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        y = y.view(*shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class QuantEmbedding(nn.Module):
    """Token ids ``(...)`` -> float32 rows ``(..., dim)`` of an embedding in GGUF blocks; also the
    tied LM head (:attr:`head`, a :class:`QuantLinear` over the same blocks: no copy)."""

    def __init__(self, weight):
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.device = torch.device("cpu")
        self.torch_decode = False   # decode rows with torch ops (off the CPU: to_device)
        self._table: torch.Tensor | None = None  # a codebook type's rows widened on a device (to_device)
        self._key = qk.weight_key(weight)
        self.head = QuantLinear([weight])
        qk.compiled_lookup()  # defined now: torch.compile cannot define an op while tracing

    def extra_repr(self) -> str:
        return f"{self.weight_q.btype.name} {self.num_embeddings}x{self.embedding_dim}"

    @property
    def nbytes(self) -> int:
        table = 0 if self._table is None else self._table.numel() * self._table.element_size()
        return self.weight_q.resident_bytes + self.weight_q.extra_bytes + table

    def to_device(self, device: torch.device | str, *, torch_decode: bool = False) -> None:
        """Keep the blocks on ``device`` (off the CPU a lookup decodes rows with torch ops there:
        what a CUDA graph can capture). Blocks already there stay as they are (on the CPU: the
        file's memory map, no copy). ``torch_decode``: decode with torch ops from a copy of the
        blocks on the CPU too, what a GPU runs (the tests pass it to check that path here)."""
        self.device = torch.device(device)
        self.torch_decode = torch_decode or not on_cpu(self.device)
        self._table = None
        if self.torch_decode and not self.weight_q.btype.linear_codes:
            # no torch decoding for a codebook type: the table widened once (float16) on the device
            self._table = qk.widen(self.weight_q, torch.float16).to(self.device)
            return
        self.weight_q.raw = self.weight_q.raw.to(self.device, copy=torch_decode)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._table is not None:
            return self._table[ids].float()
        if self.torch_decode:   # chosen once, by to_device
            w = self.weight_q
            return w.decode(w.raw.index_select(0, ids.reshape(-1))).view(*ids.shape, self.embedding_dim)
        if torch.compiler.is_compiling():
            return qk.compiled_lookup()(ids, self._key)
        return qk.lookup(self.weight_q, ids)


# ---- a decoder on quantized layers ----------------------------------------------------------
def install(decoder: nn.Module, matrices: dict[str, list], embed, head: list | None,
            floats: dict[str, torch.Tensor], compute_dtype: torch.dtype) -> None:
    """Put a GGUF's blocks into ``decoder`` (a :class:`runtime.model.decoder.Decoder` built on the
    meta device): each matrix named in ``matrices`` (``"blocks.0.attn.qkv_proj"`` -> parts)
    becomes a :class:`QuantLinear`, the embedding a :class:`QuantEmbedding` (the LM head too
    when ``head`` is None), then ``floats`` (norms and biases, named as in the decoder's
    state dict) are loaded as :meth:`Decoder.load_weights` does.

    Raises:
        RuntimeError: ``floats`` does not name exactly the decoder's remaining tensors.
    """
    for name, parts in matrices.items():
        decoder.set_submodule(name, QuantLinear(parts, floats.get(name + ".bias")))
    decoder.embed = QuantEmbedding(embed)
    decoder.lm_head = None if head is None else QuantLinear(head)
    decoder.requires_grad_(False)
    decoder.load_weights(floats, compute_dtype=compute_dtype)


def _copy_free_default(part, device: torch.device) -> str | None:
    """The prefill kernel of ``part``'s type's default pair when it needs no form beside the
    blocks and runs fast on ``device`` (ggml's widening on the CPU), else None."""
    if not on_cpu(device) or not qk.QUANT_KERNELS["ggml"].available():
        return None
    default = qc.kernel_pairs(part.btype, device)[0][1]
    return default if default in qc.COPY_FREE else None


def quant_layers(decoder: nn.Module) -> list[QuantLinear]:
    """Every :class:`QuantLinear` of ``decoder`` a token passes through, in order (each layer's
    projections, then the LM head: the embedding's when tied)."""
    out = [m for m in decoder.blocks.modules() if isinstance(m, QuantLinear)]
    head = decoder.lm_head if decoder.lm_head is not None else getattr(decoder.embed, "head", None)
    return out + ([head] if isinstance(head, QuantLinear) else [])


def token_weights(decoder: nn.Module) -> tuple[list, list]:
    """``(every part a decoded token multiplies, in order; those a prefill chunk multiplies
    with several rows: all but the LM head's)`` for :func:`runtime.kernels.quant_choice.measure_quant`."""
    layers = quant_layers(decoder)
    parts = [p for layer in layers for p in layer.parts]
    return parts, [p for layer in layers[:-1] for p in layer.parts]


#: The MLP activations the ggml graphs build (:mod:`runtime.model.ggml_layers`).
GGML_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new")


def ggml_step_unsupported(decoder: nn.Module) -> str | None:
    """Why ``decoder`` cannot decode through :class:`runtime.model.ggml_step.GGMLStep` (None: it
    can); asked here, on its layers, so that a load decides the decode mode without building
    the step.

    It needs ggml's kernels, the llama family (RMSNorm, RoPE, a gated MLP with SiLU or
    tanh-GELU), float32 activations on the CPU, every projection in GGUF blocks
    (:class:`QuantLinear`) and the reproducible mode off (its products are row-invariant
    kernels, not ggml's)."""
    if not ggml_ops.available():
        return f"ggml is unavailable ({ggml_ops.unavailable_reason()})"
    cfg = decoder.cfg
    if cfg.family != "llama" or cfg.activation not in GGML_ACTIVATIONS:
        return f"the {cfg.family} family with {cfg.activation} is not built as a ggml graph"
    if decoder.compute_dtype != torch.float32:
        return "activations are not float32"
    if decoder.numerics.reproducible:
        return "the reproducible mode runs its own row-invariant kernels"
    for block in decoder.blocks:
        for m in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
            if not isinstance(m, QuantLinear) or not on_cpu(m.device):
                return "a projection is not in GGUF blocks on the CPU"
    return None


def set_choice(decoder: nn.Module, choice: qc.QuantChoice, device: torch.device | str, *,
               background: bool = False, start: bool = True) -> PrefillForms | None:
    """Run every quantized layer of ``decoder`` with ``choice`` on ``device`` (forms made now);
    the LM head without ggml's activation rounding (:func:`runtime.kernels.quant_choice.head_choice`).

    ``background``: the prefill kernels' forms not made yet are built in a thread instead,
    prefill running the copy-free default kernels until then (:mod:`runtime.model.prefill_forms`).

    Returns:
        with ``background``, the builder (started unless ``start`` is False; ``ready`` at once
        when nothing was left to build); else None.
    """
    from runtime.device import trim_heap

    forms = PrefillForms(device) if background else None
    layers = quant_layers(decoder)
    for layer in layers[:-1]:
        layer.set_choice(choice, device, forms)
        # A repack's temporaries (int4pack decodes a matrix's codes to int32 first) are freed
        # in pieces the C heap keeps: trimmed per layer, the default model's load peaked at
        # 684 MB against 530 after it (its int4pack forms made at once, AMD EPYC Zen 4).
        trim_heap()
    layers[-1].set_choice(qc.head_choice(choice), device)
    if isinstance(decoder.embed, QuantEmbedding):
        decoder.embed.to_device(device)
    return forms.start() if forms is not None and start else forms


def make_forms(decoder: nn.Module) -> int:
    """Make now ggml's repacked form of every block part the ggml graphs multiply (each layer's
    projections; :func:`runtime.kernels.ggml_repack.repacked`: each form replaces its blocks in
    memory as it is made, so memory peaks at the blocks and one matrix), not on the first
    decoded token, where a 1B model's 520 MB of repacking would be one token's time. The LM
    head and the embedding keep their blocks (lookups read them by rows). Returns the forms'
    bytes (0: none here, or off)."""
    from runtime.kernels import ggml_repack

    total = 0
    for layer in quant_layers(decoder)[:-1]:
        for p in layer.parts:
            form = ggml_repack.repacked(p)
            total += 0 if form is None else form.nbytes
    return total


@contextlib.contextmanager
def widened_for_gradients(decoder: nn.Module) -> Iterator[int]:
    """While inside, a gradient pass widens each quantized matrix once and keeps it for the
    passes after (Explain runs dozens): yields the bytes that will take in float32 (4 bytes
    per weight of every :class:`QuantLinear`); dropped on exit. Outside, every pass widens
    each matrix again (the same memory at a pass's peak, a dequantization per pass: on the
    default model 0.6 s of a batch's 2.4 s, Intel Xeon)."""
    layers = quant_layers(decoder)
    for layer in layers:
        layer.keep_widened = True
    try:
        yield sum(4 * layer.out_features * layer.in_features for layer in layers)
    finally:
        for layer in layers:
            layer.keep_widened, layer._widened = False, None
