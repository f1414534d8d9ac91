"""The loader's first step: read a model source's weights, config and tokenizer.

Must not import Qt. A folder in transformers' layout, a GGUF run from its own blocks, or a
GGUF widened to float weights (for comparison, the reproducible mode, or an architecture our
quantized layers do not map). Never ``trust_remote_code``; a GGUF's tokenizer is read from
the file alone; never unpickle.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError
from runtime.kernels import ggml_ops
from runtime.kernels import quantized as quant_kernels
from runtime.weights import file_guard, validate
from runtime.weights.convert import decoder_state, quantize_state
from runtime.weights.folder import read_folder
from runtime.weights.gguf import open as gguf_open
from runtime.weights.gguf.converted import cached_model_config, gguf_cache_dir, load_gguf

__all__ = ["ReadWeights", "read_weights"]

log = logging.getLogger(__name__)


@dataclass
class ReadWeights:
    """What a source holds, read (the decoder is not built yet).

    Attributes:
        path: the file or folder.
        config: its :class:`ModelConfig`.
        tokenizer: the transformers tokenizer.
        dtype: the float weights' dtype (``state``'s; for ``blocks``, what a widening would use).
        state: float weights in our decoder's names, or None when ``blocks`` runs.
        blocks: a GGUF's blocks the decoder runs (:func:`runtime.weights.gguf.open.blocks`), or None.
        identity: the GGUF file as read (:mod:`runtime.weights.file_guard`); None for a folder.
        cache_folder: the GGUF's cache folder where it exists (the kernels' verdicts are kept
            there), else None.
    """

    path: Path
    config: ModelConfig
    tokenizer: Any
    dtype: torch.dtype
    state: dict | None = None
    blocks: Any = None
    identity: Any = None
    cache_folder: Path | None = None


def read_weights(path: Path, wdtype: torch.dtype, *, widen: bool) -> ReadWeights:
    """Read ``path`` (resolved: :func:`runtime.weights.sources.resolve_source`) with float weights
    of ``wdtype``. ``widen``: a GGUF that could run from its blocks is widened to ``wdtype``
    instead (``torch.int8``: widened to float32, then requantized per row).

    Raises:
        ModelLoadError, UnsupportedModelError: as :func:`runtime.loader.load.load_model`.
    """
    if path.is_dir():
        cfg, tokenizer, tensors = read_folder(path, wdtype)
        return ReadWeights(path, cfg, tokenizer, wdtype, state=decoder_state(path, cfg, tensors, wdtype))
    if not (path.exists() or path.suffix.lower() == ".gguf"):
        raise ModelLoadError(f"{path} does not exist; give a .gguf file or a model folder")
    g = gguf_open.open_gguf(path)
    # from the tensor table alone: an all-float file transformers' reader cannot read is
    # widened from our names; an architecture our quantized layers do not map, by transformers
    ours, from_blocks = gguf_open.widened_here(g), gguf_open.runs_from_blocks(g)
    identity = file_guard.FileIdentity.of(path)
    folder = gguf_cache_dir(path)
    # before any reader divides by its numbers or reads its blocks; the config kept for this
    # very file (its path, size and mtime) spares building transformers' config class (~2 s)
    validate.check_gguf(path, g, cached_model_config(folder))
    g.release_pages()  # the checks' reads: not resident beside the copies detach makes
    if not from_blocks and not ours:
        quantized = gguf_open.widening_cost(g, wdtype)
        if quantized:  # said first; no float copy of a quantized file on disk
            gguf_open.drop_stale_conversions(folder)
            log.warning("%s: its quantized weights run widened to %s in memory (%.0f MB; the file: %.0f MB)",
                        path.name, str(wdtype).removeprefix("torch."), quantized / 1e6, path.stat().st_size / 1e6)
        cfg, tokenizer, state = load_gguf(path, wdtype, keep=not quantized)
        return ReadWeights(path, cfg, tokenizer, wdtype, state=state, identity=identity,
                           cache_folder=folder if folder.exists() else None)
    gguf_open.refuse_without_ggml(path, g, None if ggml_ops.available() else ggml_ops.unavailable_reason())
    cfg, tokenizer = gguf_open.config_and_tokenizer(path, g)
    quant = gguf_open.blocks(path, g, cfg)
    file_guard.detach(quant, g)  # nothing of the file stays mapped: it may change under us
    if not widen and not ours:
        return ReadWeights(path, cfg, tokenizer, wdtype, blocks=quant, identity=identity,
                           cache_folder=folder if folder.exists() else None)
    # widened for comparison, or for reproducible replies (row-invariant float kernels): no copy on disk
    state = gguf_open.widened_state(quant, torch.float32 if wdtype == torch.int8 else wdtype, quant_kernels.widen)
    state = quantize_state(state) if wdtype == torch.int8 else state
    return ReadWeights(path, cfg, tokenizer, wdtype, state=state, identity=identity,
                       cache_folder=folder if folder.exists() else None)
