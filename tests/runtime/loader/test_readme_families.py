"""The README's sentence of model families names every GGUF architecture the loader runs, and
no family the loader refuses (a sentence that listed eight families went stale when Granite 3,
OLMo 2 and SmolLM3 were added)."""
from __future__ import annotations

import re
from pathlib import Path

from runtime.weights.gguf.open import RUNS_ARCHITECTURES

README = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")

#: How the README names each ``general.architecture`` value.
NAMED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi-3",
         "gemma2": "Gemma 2", "gemma3": "Gemma 3", "granite": "Granite 3", "olmo2": "OLMo 2",
         "smollm3": "SmolLM3", "gpt2": "GPT-2"}


def _families_sentence() -> str:
    said = re.search(r"attnchat runs decoder-only models of these families: (.+?), from a GGUF file",
                     " ".join(README.split()))
    assert said, "the README's families sentence is gone or reworded: update this test with it"
    return said.group(1)


def test_the_readme_names_every_architecture_the_loader_runs():
    sentence = _families_sentence()
    assert set(RUNS_ARCHITECTURES) == set(NAMED), "a new architecture: name it here and in the README"
    missing = [NAMED[a] for a in RUNS_ARCHITECTURES if NAMED[a] not in sentence]
    assert missing == []


def test_the_readme_names_no_family_beyond_the_loaders():
    listed = re.split(r", | and ", re.sub(r" \(and [^)]*\)", "", _families_sentence()))
    assert sorted(listed) == sorted(NAMED.values())
