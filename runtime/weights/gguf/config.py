"""A GGUF file's transformers config and tokenizer, from our own header reader: no
``gguf.GGUFReader``. Must not import Qt.

transformers builds a GGUF's config through ``load_gguf_checkpoint``, which opens the
file with ``gguf.GGUFReader``: 22 s for the default model and 79 s for Gemma 3 270M on
a busy 2-vCPU Intel Xeon (most of a first load's time without this reader). :func:`config_dict` is the
metadata half of that function (its mapping tables, defaults and special cases, applied
the same way) over :func:`runtime.weights.gguf.mmap.read_gguf_tensors`' scalars;
the tests check it gives transformers' own dict. The tokenizer comes from the class
transformers picks for the model type, built by transformers from the GGUF (its
tokenizer path already reads the file with a fast reader of its own).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from runtime.weights.gguf.mmap import GGUFTensors


def _architecture(meta: dict) -> tuple[str, str]:
    """``(architecture, transformers' name for it)`` as ``load_gguf_checkpoint`` renames them."""
    arch = str(meta.get("general.architecture", ""))
    name = str(meta.get("general.name", ""))
    updated = arch
    # llama.cpp writes Mistral models as llama; transformers reads one as Mistral (its class,
    # with Mistral's default sliding window) only when general.name is exactly "mistral" (its
    # test is membership in the one-item list it reads the field into), so ours is that test
    if "llama" in arch and name == "mistral":
        updated = "mistral"
    for key, value in (("qwen2moe", "qwen2_moe"), ("qwen3moe", "qwen3_moe"), ("gpt_oss", "gpt_oss"),
                       ("gpt-oss", "gpt_oss"), ("minimax-m2", "minimax_m2")):
        if key in arch:
            updated = value
    return arch, updated


#: Architectures transformers' GGUF reader does not read, read here: their shared keys are
#: llama's (``{arch}.block_count`` ...: read with transformers' llama table), their own are
#: :func:`_own_keys`' (llama.cpp's names for transformers' config fields).
OWN_ARCHITECTURES = ("granite", "olmo2", "smollm3")


def config_dict(g: GGUFTensors) -> dict:
    """transformers' config dict for the GGUF ``g`` (what ``load_gguf_checkpoint(path)["config"]``
    returns, for the decoder families attnchat runs; for :data:`OWN_ARCHITECTURES`, which it
    does not read, the dict of their transformers config class as llama.cpp runs the file).

    Raises:
        ValueError: an architecture transformers does not read from GGUF (and not ours).
    """
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    meta = g.metadata
    arch, updated = _architecture(meta)
    own = arch in OWN_ARCHITECTURES
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES and not own:
        raise ValueError(f"GGUF model with architecture {arch} is not supported yet.")
    config: dict = {"tie_word_embeddings": "output.weight" not in g.tensors or arch in ("falcon", "bloom")}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for gguf_key, value in meta.items():
        if isinstance(value, tuple):  # an array we did not read: only a tokenizer's, for the config
            continue
        gguf_key = gguf_key.replace(arch, updated)
        prefix, _, config_key = gguf_key.partition(".")
        if own and prefix == arch:
            prefix = "llama"
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        if prefix in renames and config_key in renames[prefix]:
            target = renames[prefix][config_key]
            if target is not None and target != -1:
                config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # a Gemma 3 GGUF holds the text backbone only
    if own:
        config.update(_own_keys(arch, meta, config))
    if "vocab_size" not in config:
        tokens = meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, tuple):  # ("array", item type, count)
            config["vocab_size"] = tokens[2]
        elif tokens is not None:
            config["vocab_size"] = len(tokens)
    return config


def _own_keys(arch: str, meta: dict, config: dict) -> dict:
    """The config fields of an :data:`OWN_ARCHITECTURES` file beyond llama's, as llama.cpp
    reads the file:

    - Granite: ``granite.embedding_scale``, ``.residual_scale``, ``.logit_scale`` and
      ``.attention.scale`` (its converter's names for ``embedding_multiplier``,
      ``residual_multiplier``, ``logits_scaling`` and ``attention_multiplier``); an absent one
      is llama.cpp's default (no scaling; the attention's ``1 / sqrt(head_dim)``, where
      GraniteConfig's default would be 1).
    - SmolLM3: no key says which layers skip RoPE; llama.cpp fixes every fourth
      (``n_no_rope_layer_step = 4``), transformers' ``no_rope_layer_interval`` default too.
    - OLMo 2: llama's keys only (its norms are in the tensors).
    """
    out: dict = {}
    if arch == "granite":
        heads = config.get("num_attention_heads") or 1
        head = config.get("hidden_size", 0) // heads
        for key, field, default in (("embedding_scale", "embedding_multiplier", 1.0),
                                    ("residual_scale", "residual_multiplier", 1.0),
                                    ("logit_scale", "logits_scaling", 1.0),
                                    ("attention.scale", "attention_multiplier", head ** -0.5 if head else 1.0)):
            value = meta.get(f"granite.{key}")
            out[field] = float(value) if isinstance(value, (int, float)) and value else default
    elif arch == "smollm3":
        n = int(config.get("num_hidden_layers") or 0)
        out["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n)]
    return out


#: Llama 3.x's RoPE scaling besides its factor, as llama.cpp's converter assumes it when it bakes
#: the scaling into ``rope_freqs.weight``: ``(low_freq_factor, high_freq_factor, original context)``.
LLAMA3_BANDS = (1.0, 4.0, 8192)


def llama3_divisors(theta: float, dim: int, factor: float, low: float = LLAMA3_BANDS[0], high: float = LLAMA3_BANDS[1],
                    original: int = LLAMA3_BANDS[2]) -> list[float]:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight`` for a
    Llama 3 RoPE scaling (``convert_hf_to_gguf.py``'s form): ``dim // 2`` floats, 1 for short
    wavelengths, ``factor`` for long ones, smooth between."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def dropped_facts(g: GGUFTensors, config: dict) -> dict:
    """What the file says that transformers' GGUF reader drops from ``config``
    (:func:`config_dict`), as config entries, so the model runs as llama.cpp runs the file:

    - a head width other than hidden / heads (``{arch}.attention.key_length``: transformers'
      Llama and Qwen3 readers keep hidden / heads or Qwen3Config's 128) -> ``head_dim``;
    - a rotated share of each head below the whole (``{arch}.rope.dimension_count`` under
      the head's width: Phi-4-mini rotates 96 of its 128 channels) -> ``partial_rotary_factor``;
    - Llama 3's RoPE scaling, which llama.cpp's converter keeps only as the tensor
      ``rope_freqs.weight`` (each frequency's divisor) -> ``rope_parameters`` of type
      ``llama3`` with the factor and bands those divisors are (Llama 3.1-3.3's);
    - Phi-3.5's and Phi-4-mini's LongRoPE, kept as ``rope_factors_short.weight`` and
      ``rope_factors_long.weight`` with ``{arch}.rope.scaling.original_context_length`` (and
      ``.attn_factor``) -> ``rope_parameters`` of type ``longrope``;
    - a linear or YaRN scaling in ``{arch}.rope.scaling.type`` / ``.factor`` (Gemma 3 4B's
      linear 8 on its global layers) -> ``rope_scaling``.

    Raises:
        ValueError: ``rope_freqs.weight`` is not a Llama 3 scaling's divisors, or LongRoPE
            factors without their other half, their original context or one per frequency
            (one line each), or a RoPE scaling type attnchat does not read.
    """
    arch = str(g.metadata.get("general.architecture", ""))
    heads = config.get("num_attention_heads")
    head = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    out: dict = {}
    key_length = g.metadata.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0 and key_length != head:
        out["head_dim"] = head = key_length
    rotated = g.metadata.get(f"{arch}.rope.dimension_count")
    if isinstance(rotated, int) and 0 < rotated < head:
        out["partial_rotary_factor"] = rotated / head
    info = g.tensors.get("rope_freqs.weight")
    if info is not None:
        theta = float(config.get("rope_theta") or 10000.0)
        dim = int(rotated) if isinstance(rotated, int) and rotated > 0 else head
        have = g.raw("rope_freqs.weight").reshape(-1).view(torch.float32).tolist() if info.ggml_type == 0 else []
        factor = max(have, default=0.0)
        want = llama3_divisors(theta, dim, factor) if factor >= 1.0 else []
        if len(have) != dim // 2 or not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(have, want)):
            raise ValueError("its rope_freqs.weight is not a Llama 3 RoPE scaling (the frequency divisors "
                             "attnchat reads from a GGUF)")
        low, high, original = LLAMA3_BANDS
        out["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                  "low_freq_factor": low, "high_freq_factor": high,
                                  "original_max_position_embeddings": original}
    long, short = g.tensors.get("rope_factors_long.weight"), g.tensors.get("rope_factors_short.weight")
    if long is not None or short is not None:
        dim = int(rotated) if isinstance(rotated, int) and rotated > 0 else head
        original = g.metadata.get(f"{arch}.rope.scaling.original_context_length")
        factors = [g.raw(n).reshape(-1).view(torch.float32).tolist() if i is not None and i.ggml_type == 0 else []
                   for n, i in (("rope_factors_long.weight", long), ("rope_factors_short.weight", short))]
        if not isinstance(original, int) or original <= 0 or any(len(f) != dim // 2 for f in factors):
            raise ValueError(f"its LongRoPE factors are not {dim // 2} float32 values each for long and short "
                             "contexts with an original context length")
        params = {"rope_type": "longrope", "rope_theta": float(config.get("rope_theta") or 10000.0),
                  "long_factor": factors[0], "short_factor": factors[1], "original_max_position_embeddings": original}
        attn = g.metadata.get(f"{arch}.rope.scaling.attn_factor")
        if isinstance(attn, (int, float)) and attn > 0:
            params["attention_factor"] = float(attn)
        if "partial_rotary_factor" in out:
            params["partial_rotary_factor"] = out["partial_rotary_factor"]
        out["rope_parameters"] = params
        out["original_max_position_embeddings"] = original
    kind = str(g.metadata.get(f"{arch}.rope.scaling.type", "none"))
    factor = g.metadata.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and isinstance(factor, (int, float)) and factor > 0 and "rope_parameters" not in out:
        scaling = {"rope_type": kind, "factor": float(factor)}
        original = g.metadata.get(f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and isinstance(original, int) and original > 0:
            scaling["original_max_position_embeddings"] = original
        out["rope_scaling"] = scaling  # transformers' config classes place it (Gemma 3: on the global layers)
    elif kind not in ("none", "linear", "yarn", "longrope"):
        raise ValueError(f"its RoPE scaling {kind!r} is not one attnchat reads from a GGUF (linear, yarn, longrope)")
    return out


def hf_config(g: GGUFTensors):
    """The transformers config object (``AutoConfig.for_model`` of :func:`config_dict`, with
    :func:`dropped_facts`)."""
    from transformers import AutoConfig

    d = dict(config_dict(g))
    d.pop("_model_name_or_path", None)
    d.update(dropped_facts(g, d))
    return AutoConfig.for_model(**d)


def tokenizer(path: Path, folder: str, model_type: str):
    """The tokenizer transformers would give the GGUF ``path``, built from the file only.

    ``folder`` is an empty private folder (transformers reads tokenizer files from the
    folder it is given: none are read beside a GGUF). The class is the one AutoTokenizer
    picks for ``model_type`` (``TokenizersBackend`` where it names none).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    if isinstance(name, (tuple, list)):
        name = next((n for n in reversed(name) if n), None)
    cls = (tokenizer_class_from_name(name) if name else None) or PreTrainedTokenizerFast
    return cls.from_pretrained(folder, gguf_file=str(Path(path).resolve()), trust_remote_code=False)
