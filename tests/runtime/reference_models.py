"""transformers' own model of a GGUF file, the truth our decoder is compared with (a helper for
tests, not a test file).

transformers' GGUF reader dequantizes a file in Python: about 40 s for the default model and 1 to
2.5 minutes for Gemma 3 270M on 2 shared cores. Its output (transformers' tensors and config) is
saved once per machine in the attnchat cache folder (:func:`models.paths.cache_dir`, ``tests/``),
in a folder named after the file's name, size and time and transformers' version, and every run,
a fresh clone's too, loads transformers' model from that folder in seconds.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

_PREFIX = "transformers-"


def transformers_model(gguf: Path, **read):
    """transformers' ``AutoModelForCausalLM`` of ``gguf``, float32, in eval mode, as its GGUF
    reader builds it with ``read`` (from_pretrained's arguments; the first time on this machine,
    read back from the cache after)."""
    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from models.paths import cache_dir

    st = gguf.stat()
    stem = f"{_PREFIX}{gguf.stem}@"  # @: the file's own name ends here
    folder = cache_dir() / "tests" / f"{stem}{transformers.__version__}-{st.st_size}-{st.st_mtime_ns}"
    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.parent.glob(stem + "*"):  # an older file or transformers
            if stale != folder:
                shutil.rmtree(stale, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **read)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the tensors are dequantized
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        part = folder / f"model.safetensors.{os.getpid()}.part"  # two runs at once write apart
        save_model(model, str(part))
        os.replace(part, folder / "model.safetensors")
        del model
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
