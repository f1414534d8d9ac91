"""Sampling values from the model's file: used for its replies (the setting on), said in the
Generation tab, and the settings' own values when off or when the file gives none."""
from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

from desktop.settings.dialog import SettingsDialog
from desktop.settings.generation_tab import model_sampling_text
from desktop.worker import EngineWorker
from tests.desktop.fakes import fake_session_factory
from tests.models.gguf_files import F32, I32, gguf, key, string_entry


def _file(tmp_path: Path) -> Path:
    return gguf(tmp_path / "qwen.gguf", string_entry("general.architecture", "qwen3"),
                key("general.sampling.temp") + struct.pack("<If", F32, 0.5),
                key("general.sampling.top_k") + struct.pack("<Ii", I32, 20))


def _load(path):
    def load(source, device):
        cfg = SimpleNamespace(max_position_embeddings=4096, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
        return SimpleNamespace(name="qwen", path=path, device="cpu", dtype="float32", config=cfg,
                               load_seconds=0.01, weights_bytes=1000)
    return load


def test_the_models_own_sampling_values_are_used_and_said(make_window, tmp_path):
    w = make_window(worker=EngineWorker(load_fn=_load(_file(tmp_path)), session_fn=fake_session_factory()))
    info = w.engine.model
    assert info["sampling"] == {"values": {"temperature": 0.5, "top_k": 20},
                                "source": "its GGUF's general.sampling.* keys"}
    gen = w.reply_generation()
    assert (gen["temperature"], gen["top_k"], gen["top_p"]) == (0.5, 20, 0.95)   # top-p: the settings' (balanced)
    assert gen["model_sampling_from"] == "its GGUF's general.sampling.* keys" and gen["seed"] >= 0
    d = SettingsDialog(w.settings, info, devices=[("auto", "Automatic"), ("cpu", "CPU")], parent=w)
    assert d.fields["generation/model_sampling"].editor.currentData() is True
    assert "Its file gives temperature 0.5, top-k 20" in model_sampling_text(info)
    w.settings.set("generation/model_sampling", False)
    gen = w.reply_generation()
    assert (gen["temperature"], gen["top_k"]) == (0.7, 40) and "model_sampling_from" not in gen


def test_without_values_in_the_file_the_settings_apply(make_window):
    w = make_window()
    assert w.engine.model.get("sampling") is None
    assert w.reply_generation()["temperature"] == 0.7
    assert model_sampling_text(w.engine.model).endswith("the values below apply (balanced: temperature 0.7, "
                                                        "as LM Studio and Jan).")
