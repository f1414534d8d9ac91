"""Bad model input raises runtime's typed errors, each with one line that names the file.

Never unpickles: pickled checkpoints carry a payload that would create a marker file
if they were ever opened with pickle, and the marker must not appear.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from runtime import load_model
from runtime.device import resolve_device
from runtime.errors import AttnchatError, DeviceError, ModelLoadError, UnsupportedModelError
from tests.runtime.tiny_models import make_tiny_model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Keep any cache the loader writes out of the user's cache folder."""
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _raises(source, error_type, name: str, *match: str) -> AttnchatError:
    """load_model(source) raises exactly ``error_type``, in one line naming ``name``."""
    with pytest.raises(error_type) as info:
        load_model(source, device="cpu")
    e = info.value
    if error_type is ModelLoadError:
        assert not isinstance(e, UnsupportedModelError), f"{type(e).__name__}: {e}"
    text = str(e)
    assert "\n" not in text and "\r" not in text, repr(text)
    assert name in text, f"{name!r} not in {text!r}"
    for word in match:
        assert word.lower() in text.lower(), f"{word!r} not in {text!r}"
    assert e.__cause__ is None or not isinstance(e.__cause__, AttnchatError)
    return e


# ---- missing, empty, truncated, not GGUF ----------------------------------------------
def test_missing_file(tmp_path):
    _raises(tmp_path / "nope.gguf", ModelLoadError, "nope.gguf", "does not exist")


def test_missing_folder(tmp_path):
    _raises(tmp_path / "no_such_model", ModelLoadError, "no_such_model", "does not exist")


def test_empty_gguf(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _raises(p, ModelLoadError, "empty.gguf", "empty")


@pytest.mark.skipif(not os.path.exists("/dev/zero") or not hasattr(os, "mkfifo"), reason="POSIX")
def test_a_fifo_or_a_device_named_gguf(tmp_path):
    """A FIFO or a device behind a .gguf name is "not a regular file", not "empty; download it
    again"."""
    os.mkfifo(tmp_path / "fifo.gguf")
    _raises(tmp_path / "fifo.gguf", ModelLoadError, "fifo.gguf", "not a regular file")
    os.symlink("/dev/zero", tmp_path / "zero.gguf")
    _raises(tmp_path / "zero.gguf", ModelLoadError, "zero.gguf", "not a regular file")


def test_truncated_real_gguf(tmp_path, default_model_file):
    p = tmp_path / "cut.gguf"
    with open(default_model_file, "rb") as f:
        p.write_bytes(f.read(1 << 20))  # the header and part of the metadata
    assert p.read_bytes()[:4] == b"GGUF"
    _raises(p, ModelLoadError, "cut.gguf", "truncated")


def test_a_gguf_cut_inside_its_tensors_says_truncated_once(tmp_path, default_model_file):
    p = tmp_path / "cut.gguf"
    with open(default_model_file, "rb") as f:
        p.write_bytes(f.read(default_model_file.stat().st_size - 1000))  # the last tensor's end missing
    e = _raises(p, ModelLoadError, "cut.gguf", "lies outside the file")
    assert str(e).lower().count("truncated") == 1, str(e)
    assert str(e).endswith("; the file may be truncated: download it again")


def test_text_file_renamed_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("these are my notes, not a model\n" * 20)
    _raises(p, ModelLoadError, "notes.gguf", "not a GGUF file")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    p = tmp_path / "encoder.gguf"
    w = gguf.GGUFWriter(str(p), "bert")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert p.read_bytes()[:4] == b"GGUF"
    _raises(p, UnsupportedModelError, "encoder.gguf", "bert")


# ---- pickles: refused, never opened ---------------------------------------------------
class _Payload:
    """Unpickling this opens (creates) ``marker`` for writing: proof it was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(marker)))


def test_payload_would_leave_a_marker(tmp_path):
    """The control: unpickling the payload does create its marker (so its absence means something)."""
    marker = tmp_path / "control-marker"
    p = tmp_path / "control.bin"
    _write_pickle(p, marker)
    pickle.loads(p.read_bytes()).close()
    assert marker.exists()


@pytest.mark.parametrize("name", ["model.bin", "model.pt", "weights.pth", "model.ckpt"])
def test_pickled_file_refused_without_unpickling(tmp_path, name):
    marker = tmp_path / "UNPICKLED"
    p = tmp_path / name
    _write_pickle(p, marker)
    _raises(p, ModelLoadError, name, "pickle", "safetensors")
    assert not marker.exists(), "the checkpoint was unpickled"


def test_folder_with_pickled_weights_refused_without_unpickling(tmp_path, tiny_llama):
    """A transformers folder (config + tokenizer) whose weights are pytorch_model.bin."""
    marker = tmp_path / "UNPICKLED"
    folder = _copy(tiny_llama, tmp_path / "old-style")
    (folder / "model.safetensors").unlink()
    _write_pickle(folder / "pytorch_model.bin", marker)
    _raises(folder, ModelLoadError, "pytorch_model.bin", "pickle")
    assert not marker.exists(), "the checkpoint was unpickled"


def test_folder_with_only_pickled_weights(tmp_path):
    marker = tmp_path / "UNPICKLED"
    folder = tmp_path / "only-bin"
    folder.mkdir()
    _write_pickle(folder / "pytorch_model.bin", marker)
    _raises(folder, ModelLoadError, "only-bin")
    assert not marker.exists(), "the checkpoint was unpickled"


# ---- folders --------------------------------------------------------------------------
def test_folder_needing_remote_code(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "custom")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    # Code that must never run: it would leave a marker.
    marker = tmp_path / "REMOTE_CODE_RAN"
    (folder / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    _raises(folder, UnsupportedModelError, "custom", "trust_remote_code")
    assert not marker.exists()


def test_encoder_only_folder(tmp_path):
    from transformers import AutoModel, BertConfig

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    folder = tmp_path / "tiny-bert"
    AutoModel.from_config(cfg).save_pretrained(str(folder), safe_serialization=True)
    assert (folder / "model.safetensors").exists()
    _raises(folder, UnsupportedModelError, "tiny-bert", "bert", "not supported")


def test_folder_without_tokenizer(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    e = _raises(folder, ModelLoadError, "no-tokenizer", "tokenizer")
    assert not isinstance(e, UnsupportedModelError)


def test_folder_without_config(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "no-config")
    (folder / "config.json").unlink()
    _raises(folder, ModelLoadError, "no-config", "config.json")


def test_folder_with_missing_tensor(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama, tmp_path / "incomplete")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _raises(folder, ModelLoadError, "incomplete", "layers.1.mlp.down_proj.weight")


def test_the_good_folder_loads(tiny_llama):
    """The control for the folder cases: the untouched copy source loads."""
    m = load_model(tiny_llama, device="cpu")
    assert m.config.model_type == "llama" and m.path == tiny_llama


# ---- device and dtype -----------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda():
    with pytest.raises(DeviceError) as info:
        resolve_device("cuda")
    assert "\n" not in str(info.value) and "CUDA" in str(info.value)


def test_unknown_device():
    with pytest.raises(DeviceError) as info:
        resolve_device("quantum")
    assert "quantum" in str(info.value) and "\n" not in str(info.value)


def test_unknown_dtype(tiny_llama):
    with pytest.raises(ValueError) as info:
        load_model(tiny_llama, device="cpu", dtype="int3")
    assert "int3" in str(info.value) and "\n" not in str(info.value)
    assert not isinstance(info.value, AttnchatError)
