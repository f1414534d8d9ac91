"""The stand-in Hub's tiny repository and the helpers the Hub tests share."""
from __future__ import annotations

import pytest

import models
from models.errors import HubError
from tests.hub_stand_in import gguf_bytes

REPO = "owner/Tiny-Instruct-GGUF"


def tiny_repo(hub, repo_id=REPO, **kw):
    files = {
        "Tiny-Instruct-Q4_K_M.gguf": gguf_bytes(payload=300_000, seed=1, layers=3, heads=4, kv_heads=2, embd=128),
        "Tiny-Instruct-Q8_0.gguf": gguf_bytes(payload=500_000, seed=2, layers=3, heads=4, kv_heads=2, embd=128),
        "Tiny-Instruct-F16-00001-of-00002.gguf": gguf_bytes(payload=600_000, seed=3),
        "Tiny-Instruct-F16-00002-of-00002.gguf": b"x" * 600_000,
        "README.md": b"# tiny\n",
    }
    files.update(kw.pop("files", {}))
    return hub.add_repo(repo_id, files, **kw)


def only_files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def fetch_error(ref, **kw) -> HubError:
    with pytest.raises(HubError) as info:
        models.hub.fetch_hub(ref, **kw)
    assert "\n" not in str(info.value)
    return info.value
