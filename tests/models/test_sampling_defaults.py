"""A model's own sampling values: a GGUF's general.sampling.* keys, a folder's generation_config.json."""
from __future__ import annotations

import json
import struct

from models.sampling_defaults import read_sampling_defaults
from tests.models.gguf_files import F32, I32, gguf, key, string_entry


def f32(name: str, v: float) -> bytes:
    return key(name) + struct.pack("<If", F32, v)


def i32(name: str, v: int) -> bytes:
    return key(name) + struct.pack("<Ii", I32, v)


def test_a_gguf_s_sampling_keys(tmp_path):
    path = gguf(tmp_path / "m.gguf", string_entry("general.architecture", "llama"), f32("general.sampling.temp", 0.6),
                f32("general.sampling.top_p", 0.95), i32("general.sampling.top_k", 20),
                f32("general.sampling.penalty_repeat", 55.0),   # outside 0..10: left out
                string_entry("llama.rope.type", "x"), f32("general.sampling.min_p", 0.1))   # after general.*: not read
    d = read_sampling_defaults(path)
    assert d.values == {"temperature": 0.6000000238418579, "top_k": 20, "top_p": 0.949999988079071}
    assert d.source == "its GGUF's general.sampling.* keys"
    assert read_sampling_defaults(gguf(tmp_path / "none.gguf", string_entry("general.architecture", "llama"))) is None
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    assert read_sampling_defaults(tmp_path / "bad.gguf") is None


def test_a_folder_s_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True}))
    d = read_sampling_defaults(tmp_path)
    assert d.values == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    assert d.source == "its generation_config.json"
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "do_sample": False}))
    assert read_sampling_defaults(tmp_path).values == {"temperature": 0.0}   # greedy
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) is None
