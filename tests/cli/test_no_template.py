"""A model without a chat template: a plain format, and the user is told so."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.runtime.tiny_models import make_tiny_model
from tests.hang import HANG_S


def test_model_without_chat_template_falls_back_and_says_so(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", max_positions=512)
    for f in folder.glob("chat_template.*"):
        f.unlink()
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, "-m", "attnchat", "chat", "--model", str(folder), "--prompt", "the a and",
         "--max-new-tokens", "5", "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert "no chat template" in proc.stderr and "plain" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["completion_tokens"] <= 5 and out["finish_reason"] in ("stop", "length")
