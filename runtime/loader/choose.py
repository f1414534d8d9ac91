"""The loader's last step: choose the built decoder's kernels and thread governors.

Must not import Qt. On the CPU: float weights get the float kernels (or, in the reproducible
variant, row-invariant ones), a GGUF's blocks the kernels per block type; both kept per
machine beside a GGUF's converted files (:func:`runtime.kernels.chooser.load_or_measure`),
else timed now. Thread counts are chosen per step by timing (:mod:`runtime.kernels.threads`).
Off the CPU: the device's defaults.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.device import DeviceProfile
from runtime.kernels import quant_choice
from runtime.kernels.choice import KernelChoice
from runtime.kernels.threads import SizedGovernors, cpu_governor
from runtime.loader.read import ReadWeights
from runtime.model import quant_layers
from runtime.model.decoder import Decoder
from runtime.model.prefill_forms import PrefillForms

__all__ = ["Chosen", "choose_kernels"]

log = logging.getLogger(__name__)


@dataclass
class Chosen:
    """What :func:`choose_kernels` chose: the decode mode, the float kernels (None for blocks or
    off the CPU), the block kernels (None for float weights), the thread governors (CPU only:
    ``decode_threads`` and ``prefill_threads``, :class:`runtime.loader.model.Model`'s fields), the
    builder of the prefill forms for a GGUF's blocks (:mod:`runtime.model.prefill_forms`)."""

    decode_mode: str
    kernels: KernelChoice | None = None
    quant_kernels: quant_choice.QuantChoice | None = None
    governors: dict = field(default_factory=dict)
    prefill_forms: PrefillForms | None = None


def choose_kernels(decoder: Decoder, weights: ReadWeights, profile: DeviceProfile, *,
                   decode_given: bool, threads: int | None) -> Chosen:
    """Choose and set ``decoder``'s kernels for ``profile`` (``decode_given``: the caller named
    the decode mode, so a GGUF's blocks on the CPU do not switch to the ggml step).

    Raises:
        ValueError: the reproducible variant with activations other than float32.
    """
    dev, mode = profile.device, profile.decode_mode
    chosen = Chosen(mode)
    if weights.blocks is not None:
        token, prefill = quant_layers.token_weights(decoder)
        if not decode_given and dev.type == "cpu":
            # A GGUF's blocks decode fastest as per-layer ggml graphs where they build (docs/benchmarks.md)
            chosen.decode_mode = "ggml" if quant_layers.ggml_step_unsupported(decoder) is None else mode
        # The ggml graphs multiply the blocks themselves: only the prefill kernel is chosen (a
        # repack beside the blocks, int4pack's, only where it prefills 10 % faster)
        chosen.quant_kernels = _choose_quant_kernels(token, prefill, dev, weights.cache_folder,
                                                     decode="ggml" if chosen.decode_mode == "ggml" else None)
        # the prefill forms (int4pack's repacks: most of a warm load) are built after the load
        chosen.prefill_forms = quant_layers.set_choice(decoder, chosen.quant_kernels, dev, background=True, start=False)
        if chosen.decode_mode == "ggml":   # the graphs' repacked forms, made at load (in place of the blocks)
            quant_layers.make_forms(decoder)
        chosen.prefill_forms.start()   # after: both make forms of the same parts and keep them in ``prepared``
        _say_widened(weights.path, decoder, chosen.prefill_forms)
    if dev.type != "cpu":
        return chosen
    decode_gov = cpu_governor(threads)
    if weights.blocks is None:  # float weights: the float kernels (a GGUF's blocks have theirs, above)
        chosen.kernels = _float_kernels(decoder, weights, profile, decode_gov.options)
        decoder.set_kernels(chosen.kernels)
        if profile.reproducible:
            _prepare_kernels(decoder)

    def decode_choice() -> int | None:  # once decode has tried every count
        return decode_gov.choice if decode_gov.calls >= len(decode_gov.options) else None

    chosen.governors = dict(decode_threads=decode_gov,
                            prefill_threads=SizedGovernors(lambda: cpu_governor(threads), start=decode_choice))
    return chosen


def _float_kernels(decoder: Decoder, weights: ReadWeights, profile: DeviceProfile, counts) -> KernelChoice:
    if not profile.reproducible:
        return _choose_kernels(decoder, weights.dtype, weights.cache_folder)
    if decoder.compute_dtype != torch.float32:
        raise ValueError(f"reproducible replies compute in float32; not {decoder.compute_dtype} (drop --compute)")
    from runtime.kernels.reproducible import reproducible_choice

    # checked on the model's own matrices under every count the governors may choose,
    # once per machine where the GGUF's cache folder keeps the verdicts
    choice = reproducible_choice(weights.dtype, [ref for ref, _ in decoder.kernel_matrices()], threads=counts,
                                 folder=weights.cache_folder)
    log.info("reproducible mode's kernel: %s", choice.reason)
    return choice


def _say_widened(path: Path, decoder: Decoder, forms: PrefillForms | None = None) -> None:
    """Say once per load what the kernels' copies beside the file's blocks cost (float16 copies
    where ggml does not load or a device has no kernel for a type; int4pack's repacks), once
    ``forms`` (the ones built in the background) are made."""
    if forms is not None and not forms.ready.is_set():
        forms.on_ready(lambda: _say_widened(path, decoder))
        return
    token, _ = quant_layers.token_weights(decoder)
    parts = {id(p): p for p in token}.values()
    extra = [p for p in parts if p.extra_bytes and p.resident]   # (a repacked form in place of its blocks is no copy)
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

    return load_or_measure(folder, kernels.FloatKernels(wdtype, measure))


def _choose_quant_kernels(token: list, prefill: list, dev: torch.device, folder: Path | None,
                          decode: str | None = None) -> quant_choice.QuantChoice:
    """The kernels per block type for a decoder on a GGUF's blocks (``token``, ``prefill``: its
    parts, :func:`runtime.model.quant_layers.token_weights`): kept beside the GGUF's config in
    the cache folder, keyed by the machine, else timed now on its own matrices
    (:func:`runtime.kernels.quant_choice.measure_quant`); off the CPU the device's defaults.
    ``decode``: the decode kernel the step runs (the ggml graphs': ``"ggml"``), only prefill chosen."""
    btypes = {p.btype for p in token}

    def measure() -> quant_choice.QuantChoice:
        choice = quant_choice.measure_quant(token, dev, prefill_weights=prefill, decode=decode)
        log.info("quantized kernels: %s (us per token: %s)", choice.kernels, choice.timings_us)
        return choice

    from runtime.kernels.chooser import load_or_measure

    return load_or_measure(folder, quant_choice.BlockKernels(btypes, dev, measure, decode=decode))


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
