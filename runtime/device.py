"""Device and dtype choice. Must not import Qt; probes nothing at import time."""
from __future__ import annotations

import dataclasses
import functools

import torch

from runtime.dtypes import WEIGHT_DTYPES, parse_weight_dtype  # noqa: F401  (re-exported)
from runtime.errors import DeviceError


def device_type(where) -> str:
    """The type (``"cpu"``, ``"cuda"``, ``"mps"``, ``"meta"`` ...) of ``where``: a
    :class:`torch.device`, a device name, or anything with a ``.device`` (a tensor, a cache,
    a layer). The one reading of a device's type that the runtime's device branches go
    through; the CPU tests take their other side with the meta device, which runs no kernel.
    """
    dev = getattr(where, "device", where)
    return dev.type if isinstance(dev, torch.device) else torch.device(dev).type


def on_cpu(where) -> bool:
    """Whether ``where`` (as :func:`device_type` takes it) is on the CPU."""
    return device_type(where) == "cpu"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> CUDA if available, then Apple MPS, then CPU; others are checked.

    Raises:
        DeviceError: the named device is not available here (one line, with what is).
    """
    name = str(device).lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"there is no {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device {device!r} was asked for but Apple MPS is not available here; use cpu or auto")
    elif dev.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    return dev


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The weights' default dtype on a device, chosen by a measured accuracy test
    (``tests/runtime/loader/test_default_dtypes.py`` runs each device's default here on the CPU,
    with that device's arithmetic: the Paris answer and >= 98 % greedy agreement with
    float32; :data:`WEIGHT_DTYPE_QUALITY` has the figures).

    - CPU: float16 weights computing in float32 (:func:`compute_dtype`). Decode
      reads every weight once per token, so half the bytes is about twice the speed
      (default model, 1,024 tokens deep, our 2-core machine: 43 tok/s against 23 for
      float32 weights) and half the memory (269 MB of weights, not 538). Cost against
      float32 weights (AMD EPYC Zen 3): the same greedy tokens over the 227 positions
      of :data:`WEIGHT_DTYPE_QUALITY`'s text (prefill and token by token) and 99.5 %
      over the 371 of ``test_int8_quality.py``'s essay token by token (100 % in one
      prefill); mean |logit difference| at most 0.008, max 0.07 (README, "Weights on
      the CPU").
      ``dtype="float32"`` gives the exact reference.
    - CUDA and MPS: float16, weights and arithmetic: half the bytes per token read,
      and tensor cores. Not bfloat16, although Ampere and newer GPUs run it: the
      default model's residual stream reaches about 25,000, bfloat16 keeps 8 bits of
      mantissa, and the model then answers the capital-of-France question with
      "L'Étoile, la Marseillaise, …" (seen on an H200 and reproduced on the CPU).
      float16 keeps 11 bits and its range (65,504) holds the stream.
    """
    return torch.float16  # CPU (computing in float32), CUDA and MPS


#: Measured quality of each weight dtype the settings offer, for the default model
#: (SmolLM2-135M-Instruct), against float32 weights: greedy agreement over 227
#: positions of English text in one prefill, and whether the chat answer to "What is the
#: capital of France?" names Paris. Each computes as :func:`compute_dtype` has it on the
#: CPU (float16 on a GPU computes in float16: same figures). Measured with
#: ``tests/runtime/loader/test_default_dtypes.py`` (which checks them) on an AMD EPYC Zen 3
#: (AVX2, no AVX-512), torch 2.13 (bfloat16 re-measured there: 227 of 227).
#: The README's table ("Weights on the CPU") adds token-by-token figures and a longer text.
WEIGHT_DTYPE_QUALITY: dict[str, dict] = {
    "float32": {"agreement": 1.0, "paris": True, "note": "the reference"},
    "float16": {"agreement": 1.0, "paris": True, "note": "half the memory, about twice the decode speed"},
    "bfloat16": {"agreement": 1.0, "paris": True,
                 "note": "computes in float32: bfloat16 arithmetic breaks this model (98.7 %, no Paris)"},
    "int8": {"agreement": 0.969, "paris": True,
             "note": "a quarter of float32's memory (weight-only, a scale per row); under the 98 % "
                     "bar, so not a default (95.7 % over the 371 positions of test_int8_quality.py)"},
}


def available_devices() -> list[tuple[str, str]]:
    """The devices this machine can run on, as ``(name, description)`` pairs.

    ``("auto", ...)`` and ``("cpu", "CPU")`` always; one ``("cuda:N", "CUDA N: <GPU name>")``
    per CUDA device; ``("mps", "Apple MPS")`` where available. Probes when called (the
    CUDA names initialise CUDA), never at import time.
    """
    out = [("auto", "Automatic (CUDA, then Apple MPS, then CPU)"), ("cpu", "CPU")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                name = torch.cuda.get_device_name(i)
            except Exception:  # noqa: BLE001 - a device we cannot query is still listed
                name = "GPU"
            out.append((f"cuda:{i}", f"CUDA {i}: {name}"))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append(("mps", "Apple MPS"))
    return out


def compute_dtype(device: torch.device | str, weight_dtype: torch.dtype | str) -> torch.dtype:
    """The activations' dtype for weights of ``weight_dtype`` on ``device`` (also the
    default KV-cache dtype, except for a GGUF's blocks on the CPU: :func:`default_cache_dtype`). Names (``"cpu"``, ``"cuda:0"``, ``"float16"``) are accepted.

    int8 weights (codes with a float32 scale per row) compute in float32 everywhere.

    float16 weights on the CPU compute in float32: CPUs without AVX512-FP16 have no
    fast float16 arithmetic (a 512-token float16 prefill ran at 158 tok/s on our
    2-core machine, float32 at 620), but torch's float16 matrix-vector kernel reads
    the weights at twice the float32 rate, and reading every weight once is what
    decoding a token costs.

    bfloat16 weights compute in float32 on every device: bfloat16 arithmetic breaks
    the default model (its residual stream reaches about 25,000 and bfloat16 keeps 8
    bits of mantissa: the Paris question gets "L'Étoile, la Marseillaise, …"), while
    bfloat16 weights with a float32 residual stream, norms and attention, matrix
    products fed bfloat16 inputs, agree with float32 on every greedy token of
    :data:`WEIGHT_DTYPE_QUALITY`'s text and answer Paris (measured on the CPU).

    Everything else computes in the weights' dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    return _compute_dtype(device_type(device), parse_weight_dtype(weight_dtype))


def _compute_dtype(dev_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    if weight_dtype in (torch.bfloat16, torch.int8):
        return torch.float32
    if dev_type == "cpu" and weight_dtype == torch.float16:
        return torch.float32
    return weight_dtype


def default_cache_dtype(device: torch.device | str, weight_dtype: torch.dtype | str, *,
                        blocks: bool = False) -> torch.dtype:
    """The KV cache's dtype when none is asked for and nothing was timed: float16 for a GGUF
    run from its own blocks on the CPU, else the compute dtype (:func:`compute_dtype`). A load
    and the memory figures ask :func:`runtime.loader.load.cache_dtype_for`, which
    takes the dtype timed on this machine for the model's head size in the first case.

    Why float16 there: that model decodes a token as one ggml graph whose flash attention
    reads the cache's keys and values in place, and float16 halves what it reads (and the
    cache's memory). On the default model (AMD EPYC Zen 4, 2 cores) a token took 11.2 ms at a
    depth of 128 and 15.1 ms at 1,024 against 12.6 and 16.0 with a float32 cache, and the
    greedy agreement with the float32-weights run, teacher-forced over 8 prompts x 128
    tokens, was 97.85 % against 97.66 % (float32 cache): float16's 11-bit mantissa is far
    below the products' own activation rounding. llama.cpp's default cache is float16 too.

    Raises:
        ValueError: an unknown dtype name.
    """
    if blocks and on_cpu(device):
        return torch.float16
    return compute_dtype(device, weight_dtype)


def linear_path(device: torch.device | str) -> str:
    """:func:`runtime.model.layers.linear`'s path for matrix products on ``device``
    (:data:`runtime.model.layers.LINEAR_PATHS`; each also runs on the CPU when passed explicitly).

    - CPU: ``"cpu"``: oneDNN's inner product for float32, float16 weights widened for
      prefill and a float16 matrix-vector product for one token.
    - CUDA and MPS: ``"accelerator"``: 16-bit weights take float32 activations rounded to
      their dtype (tensor cores), everything else ``F.linear``.
    """
    return "cpu" if on_cpu(device) else "accelerator"


def decode_mode(device: torch.device | str) -> str:
    """How one token is decoded on ``device`` (:data:`runtime.model.decode_step.DECODE_MODES`).

    - CUDA: ``"graph"``: eager decode is launch-bound on a GPU (739 kernels a step, about
      17 ms of launches against 1.8 ms of GPU work on an H200, 15 tok/s); the captured
      static step replays them in one launch (1.7 ms a step measured before fusing).
    - CPU and MPS: ``"eager"``: on the CPU the step's time is the matrix products and
      ~1,500 small operations; the static step's whole-buffer attention costs more than
      it saves there (``attnchat bench`` measures both).
    """
    return "graph" if device_type(device) == "cuda" else "eager"


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What a device runs with where the caller does not say: decided once per device
    (:func:`device_profile`), read by the loader's three steps.

    Attributes:
        device: the resolved device.
        weight_dtype: the weights' default dtype (:func:`default_dtype`).
        decode_mode: how one token is decoded (:func:`decode_mode`, or the caller's).
        linear_path: the matrix products' path (:func:`linear_path`).
        compute_dtypes: weight dtype -> the activations' dtype for it here (:func:`compute_dtype`),
            for every dtype the weights can be stored in.
        reproducible: the reproducible variant (:meth:`reproducible_variant`): a token's
            logits have the same bits however it was computed; CPU and eager decode only.
    """

    device: torch.device
    weight_dtype: torch.dtype
    decode_mode: str
    linear_path: str
    compute_dtypes: dict = dataclasses.field(default_factory=dict, compare=False)
    reproducible: bool = False

    def with_decode(self, mode: str | None) -> "DeviceProfile":
        """This profile decoding with ``mode`` (None: its own).

        Raises:
            ValueError: ``"graph"`` off CUDA (the mode's name itself is the caller's to check).
        """
        if mode is None or mode == self.decode_mode:
            return self
        if mode == "graph" and device_type(self.device) != "cuda":
            raise ValueError("decode mode 'graph' needs CUDA; use eager, static or compile")
        return dataclasses.replace(self, decode_mode=mode)

    def reproducible_variant(self) -> "DeviceProfile":
        """The reproducible mode of this profile: the same device and defaults, row-invariant
        kernels chosen by the loader.

        Raises:
            ValueError: off the CPU or with a decode mode other than eager (one line).
        """
        if not on_cpu(self.device) or self.decode_mode != "eager":
            raise ValueError("reproducible replies run on the CPU with eager decode; drop --reproducible "
                             f"or use --device cpu (asked: {self.device.type}, decode {self.decode_mode})")
        return dataclasses.replace(self, reproducible=True)


def device_profile(device: str | torch.device = "auto", *, decode: str | None = None,
                   reproducible: bool = False) -> DeviceProfile:
    """The :class:`DeviceProfile` of ``device`` (resolved as :func:`resolve_device` does), its
    decode mode ``decode`` where given, its reproducible variant with ``reproducible``. The
    defaults are decided once per resolved device in this process.

    Raises:
        DeviceError: the device is not available here.
        ValueError: ``decode="graph"`` off CUDA; ``reproducible`` off the CPU or off eager decode.
    """
    profile = _profile(resolve_device(device)).with_decode(decode)
    return profile.reproducible_variant() if reproducible else profile


def profile_of(dev: torch.device | str) -> DeviceProfile:
    """The :class:`DeviceProfile` of a device type whether or not this machine has it (the
    memory planner's figures for a GPU elsewhere): the same once-per-device defaults as
    :func:`device_profile`, without its availability check."""
    return _profile(torch.device(dev))


@functools.lru_cache(maxsize=None)
def _profile(dev: torch.device) -> DeviceProfile:
    weights, mode, path = default_dtype(dev), decode_mode(dev), linear_path(dev)
    return DeviceProfile(dev, weights, mode, path, {w: _compute_dtype(dev.type, w) for w in WEIGHT_DTYPES.values()})


def free_memory_bytes(device: str | torch.device = "cpu") -> int | None:
    """Free memory on a device in bytes (None if unknown).

    CUDA: ``torch.cuda.mem_get_info`` (free bytes the driver reports) plus what torch's
    caching allocator holds unused (it hands that out first, so the driver's figure
    alone would refuse a KV cache too early); CPU: the
    operating system's available memory (psutil); MPS: the recommended working set
    minus what torch has allocated.
    """
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            spare = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            return int(torch.cuda.mem_get_info(dev)[0]) + int(spare)
        if dev.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``).

    After a large transient allocation pattern (converting a GGUF's weights, reading a
    tokenizer's JSON) glibc keeps freed memory in its arenas, where it stays resident.
    A few milliseconds; no effect on what stays allocated.

    Returns:
        True when trimmed; False where the C library has no ``malloc_trim`` (macOS, musl,
        Windows).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """The C library's ``malloc_trim`` or None, looked up once (``find_library`` may run
    ``ldconfig``: the server trims after every reply that freed memory)."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
