"""A Hub download is checked by models.safety after its sha256 and before it enters the
model folder: a GGUF whose metadata a reader would pay gigabytes for is
refused in one line and not kept; its sha256 was right, so nothing is kept to resume."""
from __future__ import annotations

import struct

import pytest

import models
from models.errors import HubError
from tests.hub_stand_in import gguf_bytes

REPO = "owner/Bomb-GGUF"


def _bomb() -> bytes:
    """A valid tiny GGUF (the shape keys the listing reads) with one more key: an array of
    2^20 bytes (a plain reader takes 800 MB for each such array)."""
    good = gguf_bytes(payload=0)
    version, tensors, keys = struct.unpack_from("<IQQ", good, 4)
    name = b"evil.blob"
    entry = struct.pack("<Q", len(name)) + name + struct.pack("<IIQ", 9, 0, 1 << 20) + bytes(1 << 20)
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys + 1) + good[24:] + entry


def test_a_download_the_rules_refuse_is_not_kept(hub):
    hub.add_repo(REPO, {"Bomb-Q4_K_M.gguf": _bomb()})
    with pytest.raises(HubError) as e:
        models.hub.fetch_hub(f"hf.co/{REPO}:Q4_K_M")
    assert e.value.kind == "refused"
    assert str(e.value) == (f"hf.co/{REPO}/Bomb-Q4_K_M.gguf was refused: its header could not be read within "
                            "attnchat's limits ('evil.blob' is an array of 1,048,576 items; only a vocabulary may "
                            "hold more than 4,096); download it again if it was cut short, or use a model whose "
                            "metadata stays within the sizes real models use; it was not kept")
    folder = models.models_dir()
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == []
