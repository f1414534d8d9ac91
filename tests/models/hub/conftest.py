"""The stand-in Hub (tests/hub_stand_in.py) with HF_ENDPOINT pointed at it and an empty model folder."""
from __future__ import annotations

import pytest

from tests.hub_stand_in import StandInHub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running stand-in Hub; HF_ENDPOINT points at it, the model folder is empty, no token
    is set (neither HF_TOKEN nor a saved login), HF_HUB_OFFLINE is unset."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", "")
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # 64 KiB body chunks (1 MiB in use): the tiny files then arrive in several chunks, as big ones do.
    monkeypatch.setattr("models.hub.download.HTTP_CHUNK", 64 << 10)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", constants.DOWNLOAD_CHUNK_SIZE)
    server = StandInHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    yield server
    server.stop()
