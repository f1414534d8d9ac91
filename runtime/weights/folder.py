"""A model folder in transformers' layout: config.json, ``*.safetensors`` and tokenizer files.

Must not import Qt. safetensors only: a pickled checkpoint is refused, never opened; a
folder whose JSON names custom code is refused (:func:`runtime.weights.sources.refuse_custom_code`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.weights.sources import (
    PICKLE_SUFFIXES,
    model_config,
    refuse_custom_code,
    refuse_pickle,
)


def read_folder(path: Path, dtype: torch.dtype):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{path} has no config.json; give a folder in transformers' layout or a .gguf file")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e}); re-export the model") from None
    refuse_custom_code(path)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise UnsupportedModelError(f"{path.name}: its config could not be read ({str(e).splitlines()[0]}); pick a Llama-family or GPT-2 model") from None
    cfg = model_config(path, hf_config)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
            refuse_pickle(next(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES))
        raise ModelLoadError(f"{path} has no .safetensors weights; export the model with safetensors")
    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json ...); copy them from the original model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{path.name}: the tokenizer could not be loaded ({str(e).splitlines()[0]}); copy the tokenizer files from the original model") from None
    tensors: dict[str, torch.Tensor] = {}
    try:
        for shard in shards:
            tensors.update(load_file(str(shard)))
    except Exception as e:
        raise ModelLoadError(f"{shard.name} could not be read ({str(e).splitlines()[0]}); the file may be truncated: download it again") from None
    return cfg, tokenizer, tensors
