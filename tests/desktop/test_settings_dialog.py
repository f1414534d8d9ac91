"""The settings dialog: validation in the widget, persistence across a restart, the memory
planner's figures, and the settings reaching the worker's session (and its limits enforced)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from PySide6.QtCore import Qt

import runtime
from desktop.settings.values import DEFAULTS, Settings
from desktop.settings.dialog import SettingsDialog
from desktop.worker import EngineWorker
from tests.desktop.fakes import FakeSession, fake_session_factory

MIB = 2**20
DEVICES = [("auto", "Automatic"), ("cpu", "CPU"), ("cuda:0", "CUDA 0: Test GPU")]


def big_load(source, device):
    """A fake 8B-shaped model: 32 layers x 8 KV heads x 128 dims (262,144 bytes per token in float32)."""
    cfg = SimpleNamespace(max_position_embeddings=8192, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128)
    return SimpleNamespace(name="big-model", path=Path(source or "big.gguf"), device="cpu", dtype="float32",
                           config=cfg, load_seconds=0.01, weights_bytes=16 * 2**30)


@pytest.fixture
def big_window(make_window):
    return make_window(worker=EngineWorker(load_fn=big_load, session_fn=fake_session_factory()))


@pytest.fixture
def backend():
    """The attention backend is process-wide: put it back after the test."""
    before = runtime.get_attention_backend()
    yield
    runtime.set_attention_backend(before)


def dialog(window, settings=None) -> SettingsDialog:
    return SettingsDialog(settings or window.settings, window.engine.model, devices=DEVICES, parent=window)


def set_value(d: SettingsDialog, key: str, value) -> None:
    e = d.fields[key].editor
    if hasattr(e, "findData"):
        e.setCurrentIndex(e.findData(value))
    elif hasattr(e, "setPlainText"):
        e.setPlainText(value)
    else:
        e.setValue(value)


def shown_reason(d: SettingsDialog, key: str) -> str:
    f = d.fields[key]
    return f.error.text() if not f.error.isHidden() else ""


def test_invalid_values_are_refused_with_the_reason_shown(big_window):
    d = dialog(big_window)
    assert not d.errors and d.ok_button.isEnabled()
    cases = [
        ("generation/context", 9000, "at most 8,192 tokens"),
        ("generation/context", 32, "at least 64 tokens"),
        ("generation/cache_limit_mib", 0.5, "holds only 2 tokens at 262,144 bytes per token"),
        ("generation/top_p", 0.0, "above 0"),
        ("generation/min_p", 1.0, "below 1"),
        ("generation/repetition_penalty", 0.0, "above 0"),
    ]
    for key, bad, reason in cases:
        good = d.values()[key]
        set_value(d, key, bad)
        assert reason in shown_reason(d, key), (key, shown_reason(d, key))
        assert not d.ok_button.isEnabled() and not d.apply_button.isEnabled()
        assert d.fields[key].editor.toolTip() == shown_reason(d, key)
        assert not d.apply() and big_window.settings.get(key) == DEFAULTS[key]  # nothing invalid is stored
        set_value(d, key, good)
        assert shown_reason(d, key) == "" and d.ok_button.isEnabled(), key
    # A 16-bit cache halves the bytes per token: 64 MiB then holds 256 tokens, which is fine.
    set_value(d, "generation/cache_dtype", "bfloat16")
    set_value(d, "generation/cache_limit_mib", 64.0)
    assert not d.errors
    # Sinks: only the rolling policy uses them, and they must leave a window.
    set_value(d, "generation/context", 4096)
    set_value(d, "generation/sink_tokens", 5000)
    assert not d.errors and not d.fields["generation/sink_tokens"].isEnabled()
    set_value(d, "generation/overflow", "rolling")
    assert "at most 4,095" in shown_reason(d, "generation/sink_tokens")
    assert d.tabs.tabText(0).endswith("⚠") and not d.tabs.tabText(1).endswith("⚠")
    set_value(d, "generation/sink_tokens", 4)
    assert not d.errors and not d.tabs.tabText(0).endswith("⚠")


def test_an_unavailable_device_is_shown_and_refused(big_window):
    big_window.settings.set("model/device", "cuda:3")
    d = dialog(big_window)
    combo = d.fields["model/device"].editor
    assert combo.currentText() == "cuda:3 (not available)"
    assert "cuda:3 is not available on this machine" in shown_reason(d, "model/device")
    assert not d.ok_button.isEnabled()
    set_value(d, "model/device", "cuda:0")
    assert d.ok_button.isEnabled()


def test_settings_persist_across_a_restart(qtbot, big_window, tmp_path):
    d = big_window.settings_controller.open()
    assert d.isVisible() and d.planner.model["name"] == "big-model"
    edits = {
        "generation/context": 4096, "generation/cache_limit_mib": 512.0, "generation/cache_dtype": "float16",
        "generation/overflow": "rolling", "generation/sink_tokens": 8, "generation/system_prompt": "Be brief.",
        "generation/temperature": 0.7, "generation/top_k": 40, "generation/top_p": 0.9, "generation/min_p": 0.05,
        "generation/repetition_penalty": 1.1, "generation/max_new_tokens": 256, "generation/seed": 7,
        "model/device": "cpu", "model/weight_dtype": "bfloat16", "model/attention_backend": "fast",
    }
    for key, value in edits.items():
        set_value(d, key, value)
    qtbot.mouseClick(d.ok_button, Qt.MouseButton.LeftButton)
    assert not d.isVisible()
    model = big_window.settings.model   # the loaded model's file: its own context, prompt, sampling are kept for it
    assert model.endswith(".gguf")
    big_window.close()
    again = Settings(tmp_path / "settings.ini")   # a new process would read the same file
    again.use_model(model)                         # ... once it has loaded that model again
    assert {k: again.get(k) for k in edits} == edits
    assert dialog(big_window, again).values() == {**{k: again.get(k) for k in d.fields}, **edits}


def test_the_planner_in_the_dialog(big_window, monkeypatch):
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2 * 2**30)
    d = dialog(big_window)
    rows = d.planner.rows
    set_value(d, "generation/cache_dtype", "bfloat16")
    # 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072 bytes per token.
    assert rows["per_token"].text().startswith("131,072 bytes (bfloat16)") and "float32 262,144" in rows["per_token"].text()
    assert "int8 67,584" in rows["per_token"].text()  # 2 x 32 x 8 x (128 codes + a 4-byte scale)
    assert rows["at_context"].text() == "1.0 GiB (1,024 MiB)"                # 8,192 tokens, the model's maximum
    assert rows["weights"].text() == "16.0 GiB (16,384 MiB) (float32)"
    assert rows["total"].text() == "17.0 GiB (17,408 MiB): fits"              # only the cache needs room: weights loaded
    set_value(d, "generation/cache_limit_mib", 256.0)
    assert rows["in_limit"].text() == "2,048 tokens in 256.0 MiB"
    assert rows["in_free"].text() == "16,384 tokens (the model stops at 8,192)"  # the weights are already loaded
    # A bigger model given only as numbers, before fetching it: about 12 GiB at 100,000 tokens.
    d.planner.use_numbers(32, 8, 128, 100_000, params_m=0)
    assert d.planner.last_plan.kv_bytes_per_token == 131_072 and d.planner.last_plan.kv_bytes == 13_107_200_000
    assert rows["at_context"].text() == "12.2 GiB (12,500 MiB)"
    assert d.planner.figures.labelForField(rows["at_context"]).text() == "KV cache at 100,000 tokens"
    assert rows["total"].text().startswith("12.2 GiB (12,500 MiB): does not fit")
    assert "smaller cache dtype" in rows["total"].text()
    assert rows["weights"].text() == "unknown: give the parameter count"
    d.planner.params_m.setValue(1000)   # 1 B parameters at the weight dtype (auto on the CPU: float16)
    assert rows["weights"].text() == "1.9 GiB (1,907 MiB) (float16)"


def test_the_planner_counts_the_cache_policys_budget(big_window, monkeypatch):
    """The planner ignored the cache policy: with h2o keeping 256 tokens it still planned the
    whole 8,192-token cache (1 GiB) and a 256 MiB limit's 2,048 tokens as the longest context,
    while the session runs the conversation to 8,192 tokens with 256 of them cached."""
    from desktop.settings.checks import CONTEXT_KEYS, effective_context

    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2 * 2**30)
    d = dialog(big_window)
    rows = d.planner.rows
    set_value(d, "generation/cache_dtype", "bfloat16")
    set_value(d, "generation/cache_limit_mib", 256.0)
    set_value(d, "generation/cache_policy", "h2o")
    set_value(d, "generation/cache_budget", 256.0)
    assert d.planner.last_plan.kv_bytes == 256 * 131_072
    assert rows["at_context"].text() == "32.0 MiB (the h2o cache policy keeps at most 256 tokens per layer)"
    assert rows["in_limit"].text() == "any length: 32.0 MiB of 256.0 MiB at most (h2o keeps 256 tokens)"
    values = d.values()
    assert effective_context({k: values[k] for k in CONTEXT_KEYS}, big_window.engine.model) == 8192
    set_value(d, "generation/cache_budget_unit", "MiB")   # 256 MiB of cache: 2,048 tokens, the limit's own
    set_value(d, "generation/cache_budget", 64.0)
    assert d.planner.last_plan.cache_budget == 512 and rows["at_context"].text().startswith("64.0 MiB (the h2o")
    set_value(d, "generation/cache_policy", "none")
    assert rows["at_context"].text() == "1.0 GiB (1,024 MiB)" and rows["in_limit"].text() == "2,048 tokens in 256.0 MiB"
    values = d.values()
    assert effective_context({k: values[k] for k in CONTEXT_KEYS}, big_window.engine.model) == 2048


def test_settings_reach_the_worker_and_the_session(qtbot, make_window, backend):
    systems, fake = [], fake_session_factory()
    w = make_window(worker=EngineWorker(load_fn=big_load, session_fn=lambda m, system, gen: (
        systems.append(system), fake(m, system, gen))[1]))
    d = w.settings_controller.open()
    for key, value in {"generation/context": 2048, "generation/cache_limit_mib": 64.0, "generation/cache_dtype": "bfloat16",
                       "generation/overflow": "rolling", "generation/sink_tokens": 16, "generation/top_k": 40,
                       "generation/seed": 7, "generation/system_prompt": "Be brief.",
                       "model/attention_backend": "reference", "model/weight_dtype": "float16"}.items():
        set_value(d, key, value)
    assert d.apply()
    w.input.setPlainText("hello")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    session = FakeSession.instances[-1]
    gen = session.settings
    assert (gen.context_limit, gen.cache_limit_bytes, gen.cache_dtype) == (2048, 64 * MIB, "bfloat16")
    assert (gen.overflow, gen.sink_tokens, gen.sampling.top_k, gen.sampling.seed) == ("rolling", 16, 40, 7)
    assert systems == ["Be brief."]
    # Applied at once on the worker thread: the attention path; the weight dtype waits for a load.
    assert runtime.get_attention_backend() == "reference"
    assert w.engine.worker._options["weight_dtype"] == "float16"
    # The device and the weight dtype need a reload: the dialog says so and offers it.
    assert d.reload_button.isEnabled() and "Reload it" in d.reload_note.text()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        qtbot.mouseClick(d.reload_button, Qt.MouseButton.LeftButton)
    assert not d.reload_button.isEnabled()
    d.close()


def test_a_cache_limit_in_settings_stops_the_real_session(qtbot, make_window, tmp_path):
    """The tiny random Llama through the real worker and ChatSession: 512 bytes per token in
    float32, so a 0.04 MiB limit (41,943 bytes) holds 81 of its 128 tokens and caps the context there."""
    from tests.runtime.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama")
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: runtime.load_model(folder, device="cpu")))
    d = w.settings_controller.open()
    for key, value in {"generation/cache_limit_mib": 0.04, "generation/overflow": "stop",
                       "generation/max_new_tokens": 500, "generation/temperature": 0.0}.items():
        set_value(d, key, value)
    assert d.planner.rows["in_limit"].text().startswith("81 tokens")
    qtbot.mouseClick(d.ok_button, Qt.MouseButton.LeftButton)
    w.input.setPlainText("what is the same")
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    result = done.args[0]
    kv = result["stats"]["kv_cache"]
    assert result["reason"] == "context", result
    assert result["stats"]["context_limit"] == 81 and kv["limit_bytes"] == int(0.04 * MIB)
    assert kv["tokens"] == 81 and kv["allocated_bytes"] <= kv["limit_bytes"]
    session = w.engine.worker._sessions[w.current_conversation]
    assert session.settings.cache_limit_bytes == int(0.04 * MIB) and session.cache.token_limit == 81


def test_weight_dtypes_show_their_measured_quality(big_window):
    """Each weight dtype shows runtime's measured agreement with float32 and the Paris check."""
    d = dialog(big_window)
    combo = d.fields["model/weight_dtype"].editor
    texts = {combo.itemData(i): combo.itemText(i) for i in range(combo.count())}
    for name, q in runtime.WEIGHT_DTYPE_QUALITY.items():
        assert f"{q['agreement'] * 100:.1f}\u00a0% same tokens" in texts[name]
        assert texts[name].endswith("\u2713" if q["paris"] else "\u2717")
    assert texts["auto"] == "auto (a GGUF's own blocks, else float16)"


def test_an_empty_system_prompt_shows_the_one_the_template_sends(qtbot, make_window):
    """SmolLM2's template sends "You are a helpful AI assistant named SmolLM…" when none is set:
    the dialog says so instead of "No system prompt"."""
    from tests.runtime.tiny_models import SMOLLM2_TEMPLATE, make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE

    def load(source, device):
        return SimpleNamespace(**vars(big_load(source, device)), tokenizer=tok)

    w = make_window(worker=EngineWorker(load_fn=load, session_fn=fake_session_factory()))
    builtin = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert w.engine.model["builtin_system_prompt"] == builtin
    d = dialog(w)
    d.tabs.setCurrentIndex(1)
    field = d.fields["generation/system_prompt"]
    assert builtin in field.editor.placeholderText() and field.editor.toPlainText() == ""
    assert field.hint is not None and field.hint.isVisibleTo(d) and "sends its own" in field.hint.text()
    # A model whose template adds none (the tiny ChatML one) says that the model gets none.
    tok.chat_template = make_tokenizer().chat_template
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("other.gguf")
    assert w.engine.model["builtin_system_prompt"] is None
    plain = dialog(w).fields["generation/system_prompt"]
    assert plain.editor.placeholderText() == "No system prompt: the model gets none" and plain.hint is None


def test_settings_opened_while_the_model_loads_show_the_model_once_it_is_loaded(qtbot, make_window):
    """Opened during the first load it said "the model's maximum" without a figure and planned for
    "a model given as numbers" until opened again."""
    w = make_window(load=False, worker=EngineWorker(load_fn=big_load, session_fn=fake_session_factory()))
    d = w.settings_controller.open()
    assert d.model is None and d.fields["generation/context"].editor.specialValueText() == "the model's maximum"
    set_value(d, "generation/system_prompt", "Answer in one line.")   # an edit not applied yet
    d.tabs.setCurrentIndex(1)
    with qtbot.waitSignal(w.model_changed, timeout=5000):
        w.load_model("big.gguf")
    new = w.settings_controller.dialog
    assert new is not d and new.isVisible() and not d.isVisible()
    assert new.model == w.engine.model and new.model["n_layers"] == 32
    assert new.fields["generation/context"].editor.specialValueText() == "the model's maximum (8,192)"
    assert new.fields["generation/system_prompt"].editor.toPlainText() == "Answer in one line."   # kept
    assert w.settings.get("generation/system_prompt") == ""   # and still not written
    assert new.tabs.currentIndex() == 1
    # Another model while it is open: only the edit goes over, not the values shown for the old one.
    w.settings.set("generation/temperature", 0.3)
    new.reject()
    d2 = w.settings_controller.open()
    assert d2.values()["generation/temperature"] == 0.3
    set_value(d2, "generation/top_k", 7)
    with qtbot.waitSignal(w.model_changed, timeout=5000):
        w.load_model("other.gguf")   # its own settings (kept per model file) replace big.gguf's
    d3 = w.settings_controller.dialog
    assert d3 is not d2 and d3.values()["generation/top_k"] == 7
    assert d3.values()["generation/temperature"] == w.settings.get("generation/temperature") != 0.3
    d3.reject()


def test_the_cache_budget_reads_in_its_unit(big_window):
    """It showed "256.0" for a budget of 256 tokens, with no unit beside it."""
    d = dialog(big_window)
    set_value(d, "generation/cache_policy", "sinks-window")
    set_value(d, "generation/cache_budget_unit", "tokens")
    set_value(d, "generation/cache_budget", 256)
    budget = d.fields["generation/cache_budget"].editor
    assert budget.text() == "256 tokens" and d.values()["generation/cache_budget"] == 256.0
    set_value(d, "generation/cache_budget_unit", "MiB")
    set_value(d, "generation/cache_budget", 11.5)
    assert budget.text() == "11.5 MiB" and d.values()["generation/cache_budget"] == 11.5
