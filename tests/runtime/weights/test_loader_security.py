"""A model can carry no code and no memory bomb into attnchat.

- ``auto_map`` in any JSON of a model folder, in any JSON spelling and at any depth, or a
  string naming one of the folder's ``*.py`` files, is refused in one line, before
  transformers could ask "Do you wish to run the custom code? [y/N]" (stdin says y).
- A GGUF's tokenizer is read from the file alone, not from the folder it sits in.
- ``trust_remote_code=False`` is passed to every transformers loader call.
- Oversized GGUF metadata is refused from a scan of the header's sizes, in bounded memory,
  the metadata bombs of tests/models/gguf_files.py included (a reader without the scan
  takes 3-7 GB for them).
- Each refusal reaches the command line as one line and exit status 2, in bounded memory
  (the peak resident memory of the ``attnchat chat``/``serve`` process is measured).
"""
from __future__ import annotations

import ast
import json
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from runtime import load_model
from runtime.errors import ModelLoadError, UnsupportedModelError
from models.safety.gguf_scan import scan_header
from tests.models import gguf_files
from tests.runtime.tiny_models import make_tiny_model
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _plant_custom_tokenizer(folder: Path, marker: Path) -> None:
    """A tokenizer_config.json naming a tokenizer class in the folder's own Python file,
    which leaves ``marker`` if it is ever imported."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg_file.write_text(json.dumps(cfg))
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")


def _chat(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``attnchat chat`` on ``model`` with stdin attached, answering yes to any question."""
    env = {"ATTNCHAT_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "attnchat", "chat", "--model", str(model), "--prompt", "hi",
                           "--max-new-tokens", "1", "--device", "cpu"],
                          input="y\ny\ny\n", capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT)


def test_auto_map_in_the_tokenizer_config_is_refused_without_a_prompt(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "custom-tok")
    marker = tmp_path / "CUSTOM_CODE_RAN"
    _plant_custom_tokenizer(folder, marker)
    r = _chat(folder, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokenizer_config.json" in lines[0] and "custom code" in lines[0], r.stderr
    assert "[y/N]" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


@pytest.mark.parametrize("file", ["generation_config.json", "preprocessor_config.json", "sub/config.json"])
def test_auto_map_in_any_json_is_refused(tmp_path, tiny_llama, file):
    folder = shutil.copytree(tiny_llama, tmp_path / "custom")
    (folder / file).parent.mkdir(exist_ok=True)
    (folder / file).write_text(json.dumps({"auto_map": {"AutoConfig": "x.Y"}}))
    with pytest.raises(UnsupportedModelError, match="auto_map") as e:
        load_model(folder, device="cpu")
    assert file in str(e.value) and "\n" not in str(e.value)


def test_every_transformers_loader_call_refuses_remote_code():
    """Each ``from_pretrained`` / ``from_config`` call in our packages passes trust_remote_code=False."""
    calls = []
    for package in ("runtime", "attnchat", "desktop", "models"):
        for file in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("from_pretrained", "from_config")):
                    kw = {k.arg: k.value for k in node.keywords}
                    ok = isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is False
                    calls.append((f"{file.relative_to(ROOT)}:{node.lineno}", ok))
    assert len(calls) >= 8
    assert [where for where, ok in calls if not ok] == []


@pytest.mark.parametrize("file, text", [
    ("config.json", '"auto\\u005fmap": {"AutoModelForCausalLM": "modeling_evil.Evil"}'),  # an escaped key
    ("tokenizer_config.json", '"extra": {"deeper": [{"\\u0061uto_map": {"AutoTokenizer": "x.Y"}}]}'),
])
def test_auto_map_in_any_spelling_at_any_depth_is_refused(tmp_path, tiny_llama, file, text):
    folder = shutil.copytree(tiny_llama, tmp_path / "escaped")
    body = (folder / file).read_text().rstrip()
    (folder / file).write_text(body[:-1].rstrip() + ", " + text + "}")
    json.loads((folder / file).read_text())  # still JSON, with the key only a parser sees
    with pytest.raises(UnsupportedModelError) as e:
        load_model(folder, device="cpu")
    assert str(e.value) == (f"escaped needs custom code from its authors ('auto_map' in {file}: trust_remote_code), "
                            "which attnchat never runs; pick a model with a standard architecture")


def test_a_python_file_the_config_names_is_refused(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "named")
    (folder / "modeling_evil.py").write_text("raise SystemExit('ran')\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["custom_class"] = "modeling_evil.EvilForCausalLM"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"\('modeling_evil.EvilForCausalLM', a Python file of the folder, "
                                                    r"named in config.json\)"):
        load_model(folder, device="cpu")


@pytest.mark.slow
def test_a_gguf_ignores_the_files_beside_it(tmp_path, default_model_file):
    """The GGUF carries its own tokenizer: a planted tokenizer_config.json beside it is never read."""
    folder = tmp_path / "downloads"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(default_model_file)
    marker = tmp_path / "CUSTOM_CODE_RAN"
    _plant_custom_tokenizer(folder, marker)
    r = _chat(folder / "model.gguf", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not marker.exists() and "[y/N]" not in r.stdout + r.stderr


# ---- GGUF metadata --------------------------------------------------------------------
def _gguf(path: Path, *entries: bytes, tensors: int = 0) -> Path:
    """A GGUF v3 header with the given raw metadata entries (and no tensor data)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, len(entries)) + b"".join(entries))
    return path


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _string_entry(name: str, value: str) -> bytes:
    return _key(name) + struct.pack("<IQ", 8, len(value)) + value.encode()


def _array_entry(name: str, item_type: int, count: int, payload: bytes) -> bytes:
    return _key(name) + struct.pack("<IIQ", 9, item_type, count) + payload


def test_a_large_metadata_array_is_refused_quickly_in_bounded_memory(tmp_path):
    # One 3 MB byte array: gguf-py's reader took 3.4 GiB and 85 s over such a file.
    n = 3_000_000
    p = _gguf(tmp_path / "bomb.gguf", _string_entry("general.architecture", "llama"),
              _array_entry("evil.blob", 0, n, bytes(n)))
    with pytest.raises(ModelLoadError):  # once first: the imports it makes are not the file's cost
        load_model(p, device="cpu")
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match="bomb.gguf was refused") as e:
            load_model(p, device="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "'evil.blob' is an array of 3,000,000 items; only a vocabulary may hold more than 4,096" in str(e.value)
    assert peak < 16 << 20, f"{peak:,} bytes"


@pytest.mark.parametrize("entry, words", [
    (_array_entry("tokenizer.ggml.tokens", 8, 2_000_000, b""), ["2,000,000 items"]),
    (_string_entry("tokenizer.chat_template", "x" * ((1 << 20) + 1)), ["chat_template", "string"]),
    (_array_entry("evil.deep", 9, 1, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 1) + b"\0"), ["nests"]),
    (_array_entry("tokenizer.ggml.tokens", 8, 10, struct.pack("<Q", 5) + b"abcde"), ["truncated"]),
    (_key("general.x") + struct.pack("<I", 77), ["unknown value type"]),
])
def test_malformed_or_oversized_headers_are_refused(tmp_path, entry, words):
    p = _gguf(tmp_path / "odd.gguf", entry)
    with pytest.raises(ModelLoadError) as e:
        load_model(p, device="cpu")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("name", ["4x2^20-bytes", "4x2^20-empty-strings", "10000x400-items", "4000x400-items"])
def test_metadata_bombs_are_refused_in_bounded_memory(tmp_path, name):
    path = gguf_files.metadata_bomb_files(tmp_path)[name]
    with pytest.raises(ModelLoadError):  # once first: the imports it makes are not the file's cost
        load_model(path, device="cpu")
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match=f"^{path.name} was refused: its header") as e:
            load_model(path, device="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(e.value)
    assert peak < 4 << 20, f"{peak:,} bytes"  # one 1 MiB buffer of the header; a reader without the scan takes 3-7 GB


def test_too_many_tensors_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="tensors"):
        load_model(_gguf(tmp_path / "t.gguf", tensors=10**9), device="cpu")


def test_the_default_model_passes_the_scan(default_model_file):
    stats = scan_header(default_model_file)
    assert (stats.version, stats.tensors) == (3, 272)
    assert stats.items > 2 * 49_000  # the vocabulary and its merges
