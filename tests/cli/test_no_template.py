"""A model without a chat template: a plain format, and the user is told so."""
from __future__ import annotations

import json

from tests.runtime.tiny_models import make_tiny_model


def test_model_without_chat_template_falls_back_and_says_so(tmp_path, attnchat_cli):
    folder = make_tiny_model(tmp_path, "llama", max_positions=512)
    for f in folder.glob("chat_template.*"):
        f.unlink()
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    status, stdout, stderr = attnchat_cli("chat", "--model", str(folder), "--prompt", "the a and",
                                          "--max-new-tokens", "5", "--json")
    assert status == 0, stderr
    assert "no chat template" in stderr and "plain" in stderr
    out = json.loads(stdout)
    assert out["completion_tokens"] <= 5 and out["finish_reason"] in ("stop", "length")
