"""Untrusted models through the command line: a model file or folder from a stranger is refused by
``attnchat chat``, ``attnchat serve`` and ``attnchat models import`` with one line on stderr and
exit status 2, and the process's peak resident memory is measured (with its children: the
template sandbox) while it refuses.

Unchecked, the template of ``template-bomb`` takes ``attnchat chat`` to 16 GB in 150 s, the GGUF
``4x2^20-bytes`` to 3.2 GB in 255 s; ``escaped-auto-map`` loads; ``models import`` copies all.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import gguf_files
from tests.runtime.tiny_models import make_tiny_model
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]
#: Peak resident memory of a refusing ``attnchat chat``/``serve`` process (torch and
#: transformers imported; a tiny model's tokenizer loaded): 310-410 MiB measured on the
#: Intel Xeon. Without the checks these runs take 3-16 GB.
PEAK_CEILING_BYTES = 640 << 20

#: Runs the command and reports its exit status, its output and the peak resident memory of
#: it and the children it waited for (getrusage of this small wrapper's children).
_WRAP = """
import json, resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=HANG_S_VALUE)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": r.returncode, "out": r.stdout, "err": r.stderr, "peak": peak}))
""".replace("HANG_S_VALUE", str(HANG_S))


def _run(tmp_path: Path, *args: str) -> dict:
    env = {"ATTNCHAT_CACHE_DIR": str(tmp_path / "cache"), "ATTNCHAT_MODELS_DIR": str(tmp_path / "models"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", _WRAP, sys.executable, "-m", "attnchat", *args],
                       capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("untrusted")
    tiny = make_tiny_model(root / "base", "llama")
    out = {}
    bomb = shutil.copytree(tiny, root / "template-bomb")
    cfg = json.loads((bomb / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bomb / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bomb / "chat_template.jinja").write_text("{{ 'x' * 4000000000 }}")
    out["template-bomb"] = bomb
    escaped = shutil.copytree(tiny, root / "escaped-auto-map")
    text = (escaped / "config.json").read_text().rstrip()
    (escaped / "config.json").write_text(text[:-1] + ', "auto\\u005fmap": {"AutoModelForCausalLM": "evil.Evil"}}')
    (escaped / "evil.py").write_text("open('RAN', 'w').close()\n")
    out["escaped-auto-map"] = escaped
    out.update(gguf_files.metadata_bomb_files(root))
    billion = root / "billion.gguf"  # the header says a billion items; the file is 60 bytes
    gguf_files.gguf(billion, gguf_files.ARCH, gguf_files.key("evil.x") + b"\x09\0\0\0\0\0\0\0" + (10**9).to_bytes(8, "little"))
    out["billion"] = billion
    return out


def _one_line(result: dict) -> str:
    assert result["rc"] == 2, result
    lines = result["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnchat: error: ") and "Traceback" not in result["err"], result
    return lines[0]


@pytest.mark.parametrize("command, source, words", [
    ("chat", "template-bomb", "attnchat: error: the model's chat template needed over 256 MiB to render this "
                              "conversation; attnchat stopped it"),
    ("chat", "4x2^20-bytes", "attnchat: error: bytes.gguf was refused: its header could not be read within "
                             "attnchat's limits ('evil.a' is an array of 1,048,576 items"),
    ("serve", "escaped-auto-map", "attnchat: error: escaped-auto-map needs custom code from its authors ('auto_map' "
                                  "in config.json: trust_remote_code)"),
])
def test_a_refusal_is_one_line_in_bounded_memory(tmp_path, sources, command, source, words):
    extra = ["--prompt", "hi", "--max-new-tokens", "2"] if command == "chat" else ["--port", "0"]
    result = _run(tmp_path, command, "--model", str(sources[source]), "--device", "cpu", *extra)
    assert _one_line(result).startswith(words), result["err"]
    print(f"{command} {source}: peak {result['peak'] >> 20} MiB")
    assert result["peak"] < PEAK_CEILING_BYTES, f"{result['peak']:,}"
    assert not (ROOT / "RAN").exists() and not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("source, words", [
    ("escaped-auto-map", "needs custom code from its authors ('auto_map' in config.json: trust_remote_code)"),
    ("billion", "billion.gguf was refused: its header could not be read within attnchat's limits ('evil.x' is an "
                "array of 1,000,000,000 items; only a vocabulary may hold more than 4,096)"),
    ("4x2^20-empty-strings", "strings.gguf was refused"),
])
def test_models_import_refuses_what_a_load_refuses(tmp_path, sources, source, words):
    result = _run(tmp_path, "models", "import", str(sources[source]))
    line = _one_line(result)
    assert words in line and line.endswith("; nothing was imported"), line
    print(f"import {source}: peak {result['peak'] >> 20} MiB")
    assert result["peak"] < 100 << 20, f"{result['peak']:,}"  # `models` imports no torch
    models = tmp_path / "models"
    assert not models.exists() or [p.name for p in models.iterdir()] == []
