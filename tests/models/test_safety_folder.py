"""models.safety's rule on what a model folder may hold: only
regular files and folders, once links are followed, and chat templates of at most 1 MiB.

Without it, a ``generation_config.json`` linked to ``/dev/zero`` is read until memory runs out
(``attnchat chat --model DIR`` reached 10.9 GB and ended in "internal error: MemoryError"), and
a FIFO keeps the load waiting forever. The checks run in a child whose address space is capped
at what it maps plus 256 MiB (an unchecked read fails there at once instead of taking the
machine's memory) and whose run is cut at 60 s; its peak resident memory is measured.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import safety
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]

#: Checks the folder argv[1] under an address-space cap; prints the refusal (or "admitted") and
#: the child's peak resident memory (bytes) as JSON.
_CHECK = """
import json, resource, sys
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
from models import safety
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize:") + (256 << 20), resource.RLIM_INFINITY))
try:
    safety.check_model(sys.argv[1])
    said = "admitted"
except safety.Refused as e:
    said = str(e)
except MemoryError:
    said = "MemoryError"
print(json.dumps({"said": said, "peak": status("VmHWM:")}))
"""


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


def _check_in_child(folder: Path) -> dict:
    try:
        r = subprocess.run([sys.executable, "-c", _CHECK, str(folder)], capture_output=True, text=True, timeout=HANG_S,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"checking {folder.name} did not end within 60 s")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not (Path("/proc/self/status").exists() and os.path.exists("/dev/zero")), reason="Linux")
@pytest.mark.parametrize("entry", ["link-to-dev-zero", "fifo"])
def test_a_folder_holding_a_device_or_a_fifo_is_refused_in_bounded_memory(tmp_path, entry):
    folder = _folder(tmp_path, entry)
    if entry == "fifo":
        os.mkfifo(folder / "special_tokens_map.json")
        name = "special_tokens_map.json"
    else:
        os.symlink("/dev/zero", folder / "generation_config.json")
        name = "generation_config.json"
    result = _check_in_child(folder)
    assert result["said"] == (f"{entry} was refused: {name} is not a regular file (a device, a pipe or a socket); "
                              "re-export the model")
    assert result["peak"] < 64 << 20, f"{result['peak']:,}"  # the stdlib and models.safety: ~15 MB


def test_a_link_to_a_regular_file_is_read_as_the_file(tmp_path):
    """Hub snapshots are links to blobs: they stay admitted, and what they hold is checked."""
    folder = _folder(tmp_path, "snapshot")
    blob = tmp_path / "blob"
    blob.write_text(json.dumps({"auto_map": {"AutoConfig": "x.Y"}}))
    os.symlink(blob, folder / "tokenizer_config.json")
    with pytest.raises(safety.Refused) as e:
        safety.check_model(folder)
    assert e.value.kind == "custom_code" and "'auto_map' in tokenizer_config.json" in str(e.value)
    (folder / "tokenizer_config.json").unlink()
    blob.write_text("{}")
    os.symlink(blob, folder / "tokenizer_config.json")
    safety.check_model(folder)


def test_a_template_file_larger_than_any_real_one_is_refused_unread(tmp_path):
    folder = _folder(tmp_path, "big-template")
    with open(folder / "chat_template.jinja", "wb") as f:
        f.truncate((1 << 20) + 1)  # sparse: the size is what counts, nothing is read
    with pytest.raises(safety.Refused) as e:
        safety.check_model(folder)
    assert str(e.value) == ("big-template was refused: chat_template.jinja is 1,048,577 bytes, bigger than any chat "
                            "template (the limit is 1 MiB); re-export the model")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    safety.check_model(folder)
