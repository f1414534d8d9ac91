"""Settings per model file: context, system prompt, sampling and cache policy remembered for
each model, the general values for a model never set up, across a restart and a switch."""
from __future__ import annotations

from desktop.settings.values import DEFAULTS, PER_MODEL_KEYS, Settings


def test_each_model_keeps_its_own(tmp_path):
    s = Settings(tmp_path / "s.ini")
    s.set("generation/temperature", 0.4)             # no model yet: the general value
    s.use_model("/m/a.gguf")
    assert s.get("generation/temperature") == 0.4    # a model never set up reads the general values
    s.set("generation/temperature", 0.2)
    s.set("generation/system_prompt", "You are terse.")
    s.set("generation/cache_policy", "h2o")
    s.set("model/device", "cpu")                      # not per model
    changed = []
    s.changed.connect(lambda k, v: changed.append((k, v)))
    s.use_model("/m/b.gguf")
    assert s.get("generation/temperature") == 0.4 and s.get("generation/system_prompt") == ""
    assert s.get("generation/cache_policy") == "none" and s.get("model/device") == "cpu"
    assert ("generation/temperature", 0.4) in changed and ("generation/cache_policy", "none") in changed
    s.set("generation/context", 2048)
    s.sync()
    again = Settings(tmp_path / "s.ini")               # a restart
    again.use_model("/m/a.gguf")
    assert (again.get("generation/temperature"), again.get("generation/system_prompt"),
            again.get("generation/cache_policy"), again.get("generation/context")) == (0.2, "You are terse.", "h2o", 0)
    again.use_model("/m/b.gguf")
    assert again.get("generation/context") == 2048
    again.use_model("")
    assert again.get("generation/temperature") == 0.4 and again.get("generation/context") == DEFAULTS["generation/context"]
    assert "/m/a.gguf" not in "".join(again._qs.allKeys())   # no path becomes a key
    assert {"generation/context", "generation/system_prompt", "generation/temperature",
            "generation/cache_policy"} <= set(PER_MODEL_KEYS)


def test_the_window_switches_to_the_loaded_models_settings(qtbot, make_window):
    w = make_window()
    w.settings.set("generation/system_prompt", "For the fake model.")
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("other.gguf")
    assert w.settings.get("generation/system_prompt") == "" and w.generation()["system_prompt"] == ""
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("fake.gguf")
    assert w.generation()["system_prompt"] == "For the fake model."
