"""Open a GGUF for the decoder from its own blocks: config and tokenizer (kept in
the cache folder after the first load), the weights as memory-mapped blocks, and, for
``--dtype float16|float32|bfloat16|int8``, a widened state dict made from those blocks.
Must not import Qt, the decoder or the kernels (the loader hands in the widening).

Nothing full-precision is written to disk: the GGUF is the weights' cache. What the
cache folder keeps is transformers' config and tokenizer files and our config
(:mod:`runtime.weights.gguf.converted`); the first load builds them from our own
header reader (:mod:`runtime.weights.gguf.config`) instead of ``gguf.GGUFReader``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch

from models.safety.gguf_scan import GGUFHeaderError
from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.weights import checked
from runtime.weights.checked import check_gguf_file, check_gguf_metadata
from runtime.weights.gguf import config as gguf_config
from runtime.weights.gguf import header_cache
from runtime.weights.gguf.converted import (
    _read_cached_fast,
    _write_cache,
    _write_model_config,
    gguf_cache_dir,
    gguf_only,
    read_cached,
)
from runtime.weights.gguf.mmap import GGUFTensors, UnknownBlockType, read_gguf_tensors
from runtime.weights.gguf.names import ARCHITECTURES, GGUFWeights, MissingTensorError, gguf_weights
from runtime.weights.quant_types import BLOCK_TYPES, BY_ID, BlockType, type_name
from runtime.weights.sources import model_config, one_line

log = logging.getLogger(__name__)


def open_gguf(path: Path) -> GGUFTensors:
    """The file's tensor table and metadata (bounded, as every GGUF read; no tensor read).

    Raises:
        ModelLoadError: not a GGUF, truncated, or past the header limits.
        UnsupportedModelError: a tensor of a block type attnchat does not run (one line naming
            the tensor and the type, from the header alone: no weight is read).
    """
    check_gguf_file(path)
    check_gguf_metadata(path)
    try:
        g = header_cache.load(path)   # (a file that passed every check, unchanged since)
        before = None if g is not None else checked.identity(path)
        if g is None:
            g = read_gguf_tensors(path)
    except UnknownBlockType as e:
        raise UnsupportedModelError(f"{path.name}: {e}; {_PICK_ANOTHER}") from None
    except GGUFHeaderError as e:
        raise ModelLoadError(f"{path.name} could not be read ({e}); the file may be truncated: download it again") from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror})") from None
    refuse_architecture(path, g)
    refuse_unrunnable_types(path, g)
    if before is not None:   # read now, and not refused: kept for the next load
        header_cache.keep(path, g, before)
    return g


#: GGUF architectures the decoder runs: the quantized layers' (:data:`names.ARCHITECTURES`) and
#: GPT-2 (widened through transformers' reader).
RUNS_ARCHITECTURES = (*ARCHITECTURES, "gpt2")


def refuse_architecture(path: Path, g: GGUFTensors) -> None:
    """Refuse, from the header, a mixture-of-experts model (an ``ARCH.expert_count`` above 1,
    or expert tensors ``*_exps.*``: Qwen3-30B-A3B, OLMoE, Mixtral's "llama" files) and an
    architecture the decoder does not run (OLMo 3, Granite 4's hybrid, Mamba ...).

    Raises:
        UnsupportedModelError: one line naming the architecture.
    """
    arch = str(g.metadata.get("general.architecture", ""))
    experts = g.metadata.get(f"{arch}.expert_count")
    if (isinstance(experts, int) and experts > 1) or any("_exps." in n for n in g.tensors):
        count = f", {experts} experts" if isinstance(experts, int) else ""
        raise UnsupportedModelError(f"{path.name} is a mixture-of-experts model (architecture {arch!r}{count}); "
                                    "attnchat runs dense models only: pick a dense one")
    if arch not in RUNS_ARCHITECTURES:
        raise UnsupportedModelError(f"{path.name}: architecture {arch!r} is not one attnchat runs "
                                    f"({', '.join(RUNS_ARCHITECTURES)})")


_PICK_ANOTHER = f"attnchat runs {', '.join(BLOCK_TYPES)}: pick another quant of this model"


def refuse_unrunnable_types(path: Path, g: GGUFTensors) -> None:
    """Refuse a file with a weight (a tensor of two or more dimensions) in a type of no row of
    :data:`runtime.weights.quant_types.BLOCK_TYPES` (gguf's Q8_K, Q8_1, the integer types, F64):
    from the tensor table only, before any weight is read.

    Raises:
        UnsupportedModelError: naming the first such tensor and its type.
    """
    for info in g.tensors.values():
        if len(info.shape) >= 2 and info.ggml_type not in BY_ID:
            raise UnsupportedModelError(f"{path.name}: tensor {info.name!r} is {type_name(info.ggml_type)}, a block type "
                                        f"attnchat does not run; {_PICK_ANOTHER}")


def runs_from_blocks(g: GGUFTensors) -> bool:
    """Whether our quantized layers take this file (:func:`types_run_from_blocks` on its
    architecture and its matrices' block types)."""
    matrices = [i for i in g.tensors.values() if len(i.shape) == 2]
    return types_run_from_blocks(str(g.metadata.get("general.architecture", "")),
                                 [BY_ID.get(i.ggml_type) for i in matrices])


def types_run_from_blocks(architecture: str, types: Sequence[BlockType | None]) -> bool:
    """Whether a GGUF of family ``architecture`` whose layer matrices are of ``types`` (None:
    a type we do not know) runs from its own blocks: a family :mod:`runtime.weights.gguf.names`
    maps, every matrix in a block type of :mod:`runtime.weights.quant_types`, at least one of
    them quantized (an all-float16 file loads as float16 weights). The loader decides by it
    for a file, the fit check for a file it only knows by its quant tag."""
    if architecture not in ARCHITECTURES or not types or any(t is None for t in types):
        return False
    return any(t.quantized for t in types)


def widened_here(g: GGUFTensors) -> bool:
    """Whether an all-float file (F16, BF16, F32 matrices) is widened through our own names
    rather than transformers' GGUF reader: the architectures that reader does not read
    (:data:`runtime.weights.gguf.config.OWN_ARCHITECTURES`)."""
    matrices = [i for i in g.tensors.values() if len(i.shape) == 2]
    return (str(g.metadata.get("general.architecture", "")) in gguf_config.OWN_ARCHITECTURES and bool(matrices)
            and all(i.ggml_type in BY_ID and not BY_ID[i.ggml_type].quantized for i in matrices))


def refuse_without_ggml(path: Path, g: GGUFTensors, ggml_why: str | None) -> None:
    """Where ggml does not load (``ggml_why`` says why; None: it loads), refuse a file with a
    weight only ggml decodes (Q1_0: gguf-py has no decoder for it), from the tensor table:
    before any weight is read.

    Raises:
        UnsupportedModelError: naming the tensor, its type and why ggml does not load.
    """
    if ggml_why is None:
        return
    for info in g.tensors.values():
        t = BY_ID.get(info.ggml_type)
        if t is not None and t.quantized and not t.gguf_decodes:
            raise UnsupportedModelError(
                f"{path.name}: tensor {info.name!r} is {t.name}, which only ggml's kernels decode, and ggml does not "
                f"load here ({ggml_why}); install ggml-python (pip install -r requirements-ggml.txt) or pick another quant")


def widening_cost(g: GGUFTensors, dtype: torch.dtype) -> int:
    """Bytes the file's quantized tensors take widened to ``dtype`` (0: no quantized tensor)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for info in g.tensors.values():
        t = BY_ID.get(info.ggml_type)
        if t is not None and t.quantized:
            n = 1
            for d in info.shape:
                n *= d
            total += n * size
    return total


def drop_stale_conversions(cached: Path | None) -> int:
    """Delete float copies of a quantized GGUF's weights that earlier versions kept in its cache
    folder (``decoder-v*.safetensors``: 544 MB to 1 GB for Gemma 3 270M Q4_K_M): a file that runs
    from its blocks never reads them. Returns the bytes freed (a file that cannot be deleted is
    left, logged)."""
    freed = 0
    for f in sorted(cached.glob("decoder-v*.safetensors")) if cached is not None and cached.is_dir() else []:
        try:
            size = f.stat().st_size
            f.unlink()
            freed += size
        except OSError:
            log.warning("could not delete the stale converted weights %s", f, exc_info=True)
    if freed:
        log.info("deleted %.0f MB of float weights an earlier version kept in %s", freed / 1e6, cached)
    return freed


def _hf_config(path: Path, g: GGUFTensors):
    try:
        return gguf_config.hf_config(g)
    except ValueError as e:
        raise UnsupportedModelError(f"{path.name}: {one_line(e).rstrip('.')}; attnchat runs Llama-family and GPT-2 models") from None


def config_and_tokenizer(path: Path, g: GGUFTensors) -> tuple[ModelConfig, object]:
    """The model's config and tokenizer: from the cache folder when it has them, else built
    from the file (our header reader for the config, transformers' own GGUF tokenizer path)
    and kept there.

    Raises:
        UnsupportedModelError: an architecture transformers or our decoder do not run.
        ModelLoadError: the tokenizer cannot be built from the file.
    """
    cached = gguf_cache_dir(path)
    drop_stale_conversions(cached)
    cfg, tokenizer = _read_cached_fast(cached)
    if cfg is not None:
        return cfg, tokenizer
    kept, tokenizer = read_cached(cached)
    # the config from the header even when one is kept (cheap): a kept one may predate what
    # this reader takes from the file (gguf.config.dropped_facts)
    hf_config = _hf_config(path, g)
    if kept is None:
        try:
            with gguf_only(path) as (folder, _name):
                tokenizer = gguf_config.tokenizer(path, folder, hf_config.model_type)
        except Exception as e:
            raise ModelLoadError(f"{path.name}: its tokenizer could not be built ({type(e).__name__}: {one_line(e)}); "
                                 "the file may be damaged: download it again") from None
        _write_cache(cached, hf_config, tokenizer)
    cfg = model_config(path, hf_config)
    _write_model_config(cached, cfg)
    return cfg, tokenizer


def blocks(path: Path, g: GGUFTensors, cfg: ModelConfig) -> GGUFWeights:
    """The decoder's weights as the file's blocks (:func:`runtime.weights.gguf.names.gguf_weights`).

    Raises:
        ModelLoadError: a tensor missing or unreadable.
    """
    try:
        return gguf_weights(g, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)
    except (MissingTensorError, KeyError, ValueError, OSError) as e:
        raise ModelLoadError(f"{path.name}: {one_line(e).strip(chr(34) + chr(39))}") from None


def widened_state(weights: GGUFWeights, dtype: torch.dtype,
                  widen: Callable[[object, torch.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's state dict with every matrix widened to ``dtype`` by ``widen(part, dtype)``
    (the kernels' widening: ggml's ``to_float`` where it loads) and every other tensor cast
    to ``dtype``, as :func:`runtime.weights.convert.to_decoder_state` gives them. int8 is not
    a widening: pass float32 and quantize the result."""
    state = {name: t.to(dtype) for name, t in weights.floats.items()}
    for name, parts in weights.matrices.items():
        state[name + ".weight"] = torch.cat([widen(p, dtype) for p in parts]) if len(parts) > 1 else widen(parts[0], dtype)
    state["embed.weight"] = widen(weights.embed, dtype)
    if weights.head is not None:
        state["lm_head.weight"] = torch.cat([widen(p, dtype) for p in weights.head])
    return state
