"""Architectures the decoder does not run, and mixture-of-experts files, are refused from the
header in one line naming the architecture (random-weight files with the real metadata keys
of each: a tiny Llama file with its ``llama.*`` keys renamed, as llama.cpp's converter names them)."""
from __future__ import annotations

import pytest

from runtime import load_model
from runtime.errors import UnsupportedModelError
from runtime.weights.gguf import open as gguf_open
from tests.runtime.tiny_gguf import make_tiny_gguf


def _as_arch(src, dst, arch: str, extra: dict | None = None):
    """``src`` rewritten with ``general.architecture = arch`` and its ``llama.*`` keys as ``arch.*``."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        kind = f.types[0]
        w.add_key_value(f.name.replace("llama.", f"{arch}.", 1), f.contents(), kind,
                        sub_type=f.types[-1] if kind == GGUFValueType.ARRAY else None)
    for key, value in (extra or {}).items():
        w.add_uint32(key.format(arch=arch), value)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), matrix_type="Q8_0", embed_type="Q8_0")


@pytest.mark.parametrize("arch", ["olmo3", "granitehybrid", "mamba"])
def test_an_architecture_the_decoder_does_not_run(tiny, tmp_path, monkeypatch, arch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = _as_arch(tiny, tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path, device="cpu")
    assert str(info.value) == (f"{arch}.gguf: architecture '{arch}' is not one attnchat runs (llama, mistral, qwen2, "
                               "qwen3, gemma2, gemma3, phi3, granite, olmo2, smollm3, gpt2)")


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "llama"])
def test_a_mixture_of_experts_file_is_refused(tiny, tmp_path, arch):
    path = _as_arch(tiny, tmp_path / f"{arch}-moe.gguf", arch, {"{arch}.expert_count": 8, "{arch}.expert_used_count": 2})
    with pytest.raises(UnsupportedModelError) as info:
        gguf_open.open_gguf(path)
    assert str(info.value) == (f"{arch}-moe.gguf is a mixture-of-experts model (architecture '{arch}', 8 experts); "
                               "attnchat runs dense models only: pick a dense one")
