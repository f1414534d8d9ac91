"""The decoder's building blocks: the linear product per device path, ``Linear``,
``Embedding``, ``Norm`` and the MLP.

Must not import Qt. Matrix products on the CPU go through oneDNN (:func:`linear`; see
:mod:`runtime.kernels.onednn` for why) or, once a decoder chose them by timing, the
measured CPU kernels of :mod:`runtime.kernels`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.config.model import ModelConfig
from runtime.kernels import cpu as cpu_kernels
from runtime.kernels import onednn
from runtime.kernels.choice import KernelChoice
from runtime.kernels.choice import apply as apply_kernel
from runtime.kernels.cpu import WeightRef

__all__ = ["LINEAR_PATHS", "linear", "Linear", "Embedding", "Norm", "MLP", "Numerics", "Scale"]


class Numerics:
    """How a decoder's layers compute where its device profile decides
    (:class:`runtime.device.DeviceProfile`): one object that the decoder shares with every
    layer, as it shares its hooks list, so the choice is set in one place
    (:meth:`runtime.model.decoder.Decoder.use_profile`) and read where it is used.

    Attributes:
        linear_path: the matrix products' path (:data:`LINEAR_PATHS`; per device:
            :func:`runtime.device.linear_path`): every :class:`Linear` and the LM head.
        reproducible: the profile's reproducible variant: attention by
            :func:`runtime.model.attention_rows.attention_rows` (a query's output the same in a
            prefill chunk and a one-token step) and the MLP's activation composed of ops that
            give an element the same bits wherever it sits. Float32 on the CPU only.
    """

    def __init__(self, reproducible: bool = False, linear_path: str = "cpu") -> None:
        self.reproducible = reproducible
        self.linear_path = linear_path


def _rounded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded to the 16-bit ``weight``'s dtype, a 16-bit product (float32
    accumulation inside the kernel), the result back in float32."""
    out = F.linear(x.to(weight.dtype), weight).to(torch.float32)
    return out if bias is None else out + bias


#: The matrix-product paths of :func:`linear`, one per kind of device (chosen by
#: :func:`runtime.device.linear_path`; any of them runs on the CPU when passed explicitly).
LINEAR_PATHS = ("cpu", "accelerator")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, path: str = "cpu"
) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``: ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``
    in ``x``'s dtype.

    ``path`` (:data:`LINEAR_PATHS`, chosen per device by :func:`runtime.device.linear_path`):

    - ``"cpu"``, ``x`` and ``weight`` both float32 or both bfloat16: oneDNN's inner product
      (the kernel PyTorch's own compiler uses for CPU linear layers), which keeps both
      cores busy on a single token (where this CPU's oneDNN has it for the dtype).
    - float32 ``x`` with 16-bit (float16 or bfloat16) ``weight``: 16-bit weights
      computing in float32 (see :func:`runtime.device.compute_dtype`). On the
      ``"accelerator"`` path, and for one token on the ``"cpu"`` path, ``x`` is rounded to the weight's dtype for a 16-bit product
      (tensor cores; on the CPU torch's float16 matrix-vector kernel reads weights at
      about 25 GB/s); on the ``"cpu"`` path more tokens widen the weight to float32 in a scratch
      buffer, a big matrix a block of rows at a time (:func:`runtime.kernels.cpu.widened_product`),
      so prefill keeps float32 arithmetic.
    - Inside ``torch.compile``: float32 on the ``"cpu"`` path through oneDNN as above when
      :func:`runtime.kernels.onednn.register_compiled_op` found it (inductor's own choice for an unfrozen
      weight is MKL's GEMV, which read the default model's weights at 11 GB/s against
      oneDNN's 17 on an AMD EPYC Zen 3, 2 cores); 16-bit weights as above; else ``F.linear``.
    - Anything else and anything that needs gradients: ``F.linear``.
    """
    sixteen = x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16)
    if torch.compiler.is_compiling():
        if sixteen:
            return _rounded(x, weight, bias)
        if onednn.compiled_op_ready and path == "cpu" and x.dtype == weight.dtype == torch.float32:
            # an opaque op to inductor: it calls oneDNN's inner product as is
            out = torch.ops.attnchat.onednn_linear(x, weight)
            return out if bias is None else out + bias
        return F.linear(x, weight.to(x.dtype), bias)
    if path == "cpu" and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        if sixteen:
            if x.numel() == x.shape[-1]:  # one token
                return _rounded(x, weight, bias)
            # float32 in the kernels' scratch buffer, a big matrix in blocks of rows
            return cpu_kernels.widened_product(_cpu_product, x, weight, None, bias)
        return _cpu_product(x, weight, bias)
    elif sixteen and not torch.is_grad_enabled():
        return _rounded(x, weight, bias)
    if sixteen and not weight.requires_grad:   # gradients for x only (runtime.insight.explain)
        out = _WidenedForInput.apply(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight.to(x.dtype), bias)


class _WidenedForInput(torch.autograd.Function):
    """``x @ weight.T`` for float32 ``x`` that needs its gradient and a 16-bit ``weight`` that
    does not. ``F.linear(x, weight.float())`` keeps the float32 copy for the backward pass:
    every matrix of the model, widened, held per forward (650 MB for the default model).
    This keeps the 16-bit weight and widens it again in the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x @ weight.to(x.dtype).T   # (..., out); the widened copy is freed at once

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None   # (..., in)


def _cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product when ``x`` and ``weight`` share a dtype it runs here, else ``F.linear``."""
    if x.dtype in onednn.DTYPES and weight.dtype == x.dtype:
        op = onednn.linear_op(x.dtype)
        if op is not None:
            return op(x, weight, bias, "none", [None], "")
    return F.linear(x, weight.to(x.dtype), bias)


def kernel_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product goes through the measured CPU kernels (set only on a CPU model, see
    :meth:`Decoder.set_kernels`): float32 activations (what they were timed for), never
    with gradients, nor inside ``torch.compile``, where inductor picks its own."""
    return (x.dtype == torch.float32 and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def weight_ref(module: nn.Module) -> WeightRef:
    """A module's matrix (and int8 row scales, if any) for :mod:`runtime.kernels`."""
    return WeightRef(module.weight, getattr(module, "weight_scale", None))


def dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 codes ``(out, in)`` times per-row ``scale (out,)``, as ``dtype`` (any device)."""
    return (weight.to(torch.float32) * scale.unsqueeze(1)).to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear`, or the measured CPU kernels
    (:mod:`runtime.kernels`) once :meth:`Decoder.set_kernels` chose them; no random init
    (see :class:`Embedding`). int8 weights carry per-row scales in ``weight_scale (out,)``."""

    kernels: KernelChoice | None = None
    weight_ref: WeightRef | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: The decoder's numerics (a layer built alone has its own): its path is this layer's.
        self.numerics = Numerics()

    @property
    def path(self) -> str:
        """The product's path (:data:`LINEAR_PATHS`), the numerics' (:meth:`Decoder.use_profile`)."""
        return self.numerics.linear_path

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and kernel_path(x, self.weight):
            return apply_kernel(self.kernels, x, self.weight_ref, self.bias)
        if self.kernels is not None and self.kernels.decode == "mkl" and torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)  # the measured choice, also compiled
        scale = getattr(self, "weight_scale", None)
        weight = self.weight if scale is None else dequantized(self.weight, scale, x.dtype)
        return linear(x, weight, self.bias, path=self.path)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without the random init: the decoder's weights always come from
    :meth:`Decoder.load_weights`, and initializing on the meta device imports torch's
    meta kernels (1.4 s of a 3 s start on our 2-core machine). int8 rows carry a scale
    each in ``weight_scale (V,)``: a lookup returns ``codes * scale`` in float32."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        scale = getattr(self, "weight_scale", None)
        return out if scale is None else out.to(torch.float32) * scale[ids].unsqueeze(-1)


class MLP(nn.Module):
    """Gated (llama family: ``down(act(gate(x)) * up(x))``, SiLU = SwiGLU, tanh-GELU = Gemma's
    GeGLU) or GELU (GPT-2: ``proj(gelu(fc(x)))``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.family == "llama"
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, (2 if self.gated else 1) * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = cfg.activation
        if cfg.activation == "silu":
            self.act = F.silu
        else:  # gelu_pytorch_tanh, gelu_new: the tanh approximation; gelu: exact
            approx = "none" if cfg.activation == "gelu" else "tanh"
            self.act = lambda t: F.gelu(t, approximate=approx)
        #: The decoder's numerics (a layer built alone has its own). In the reproducible mode the
        #: activation is composed of ops that give an element the same bits wherever it sits:
        #: torch's fused SiLU and GELU compute a thread's last few elements with scalar code that
        #: differs from their vector code in the last bit (597 of 14,000 SiLU values, Intel Xeon
        #: 2 vCPUs); exp, tanh and erf run the vector code on the tail too, and +, *, / are exact.
        self.numerics = Numerics()

    def _exact_act(self, t: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return t / (torch.exp(-t) + 1.0)
        if self.activation == "gelu":
            return t * (torch.erf(t * (1.0 / math.sqrt(2.0))) + 1.0) * 0.5
        inner = (t + t * t * t * 0.044715) * math.sqrt(2.0 / math.pi)
        return t * (torch.tanh(inner) + 1.0) * 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        act = self._exact_act if self.numerics.reproducible else self.act
        if self.gated:
            gate, up = h.split(self.intermediate, dim=-1)
            return self.down_proj(act(gate) * up)
        return self.down_proj(act(h))


class Norm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) for the llama family, LayerNorm for GPT-2.

    Gemma's RMSNorm multiplies by ``1 + w``: :meth:`Decoder.load_weights` folds the
    offset into the weight once (``weight`` then holds ``1 + w``).
    """

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        dim = dim or cfg.hidden_size
        self.rms = cfg.family == "llama"
        self.eps = cfg.norm_eps
        self.offset = cfg.norm_offset
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Scale(nn.Module):
    """``x * factor`` (Granite's ``residual_multiplier`` on a residual branch's output)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor
