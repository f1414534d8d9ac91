"""Settings that carry: the serve toggle serves with the window's cache and context settings
(and says so beside it), exports carry the system prompt and settings the replies were
written with, and save dialogs start in the documents folder."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

import desktop.file_dialogs as file_dialogs
from desktop.chat.export import conversation_markdown
from desktop.remote.serve_toggle import serve_command


def test_the_server_gets_the_windows_cache_and_context_settings(qtbot, make_window):
    w = make_window()
    for key, value in (("generation/cache_dtype", "int8"), ("generation/context", 856), ("model/weight_dtype", "float16")):
        w.settings.set(key, value)
    toggle = w.serve_toggle
    # Beside the toggle, before it starts: what it will serve with.
    assert toggle.settings_action.text() == "Uses this window's settings: int8 KV cache, context 856 tokens, float16 weights"
    asked = []

    def command(model_path, device, **options):
        asked.append(options)
        return sys.executable, ["-c", "import time; print('attnchat: serving fake.gguf on cpu at "
                                      "http://127.0.0.1:1/v1', flush=True); time.sleep(600)"]

    toggle.server.command_fn = command
    toggle.action.trigger()
    qtbot.waitUntil(lambda: toggle.server.state == "serving", timeout=30_000)
    try:
        # It served with float32 / 8,192 while the window was set to int8 / 856.
        # ... and on the port kept in the settings (chosen free once)
        assert asked == [{"context": 856, "cache_dtype": "int8", "weight_dtype": "float16", "reproducible": False,
                          "port": int(w.settings.get("server/port"))}]
        assert 0 < asked[0]["port"] < 65536
        _, args = serve_command("/m/fake.gguf", "cpu", **asked[0])
        assert "--reproducible" not in args and "--reproducible" in serve_command("/m/f.gguf", "cpu", reproducible=True)[1]
        assert args[args.index("--context") + 1] == "856" and args[args.index("--cache-dtype") + 1] == "int8"
        assert args[args.index("--dtype") + 1] == "float16"
        w.settings.set("generation/context", 2048)   # a change while it runs does not reach it: said so
        assert toggle.settings_action.text() == "Serving with int8 KV cache, context 856 tokens, float16 weights"
        assert "int8 KV cache, context 856 tokens" in toggle.label.toolTip()
    finally:
        toggle.action.trigger()
        qtbot.waitUntil(lambda: toggle.server.state == "stopped", timeout=15_000)
    # Defaults add nothing to the command line but the context the window's replies get.
    _, args = serve_command("/m/fake.gguf", "cpu", context=0, cache_dtype="auto", weight_dtype="auto")
    assert not {"--context", "--cache-dtype", "--dtype"} & set(args)


def reply(qtbot, w, text):
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit(text)


def test_exports_carry_the_system_prompt_and_the_settings_of_the_replies(qtbot, make_window, tmp_path):
    w = make_window(script=["Arr."])
    w.settings.set("generation/system_prompt", "You are a pirate.")
    w.settings.set("generation/temperature", 0.7)
    w.settings.set("generation/cache_dtype", "int8")
    reply(qtbot, w, "Hello")
    w.settings.set("generation/temperature", 0.2)
    w.settings.set("generation/system_prompt", "You are a parrot.")
    reply(qtbot, w, "And again")
    conv = w.current_conversation
    w.export_conversation(conv, "markdown", tmp_path / "c.md")
    w.export_conversation(conv, "json", tmp_path / "c.json")
    md = (tmp_path / "c.md").read_text()
    # They had the messages only: nothing said what shaped the replies.
    assert md.startswith("# Hello\n\n## System\n\nYou are a pirate.\n")
    assert "_Settings: model fake-model · temperature 0.7 · top-k 40 · top-p 0.95 · " in md
    assert "KV-cache dtype int8" in md and "seed random" in md
    changed = md.index("## System (changed for the next reply)\n\nYou are a parrot.")
    assert md.index("## You\n\nAnd again") < changed < md.rindex("## Assistant")   # just before that reply
    assert "_Settings changed for the next reply: temperature 0.2_" in md
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["system_prompt"] == "You are a pirate." and data["settings"]["temperature"] == 0.7
    assert data["settings"]["cache_dtype"] == "int8" and data["settings"]["model"] == "fake-model"
    replies = [m for m in data["messages"] if m["role"] == "assistant"]
    assert [m["stats"]["settings"]["system_prompt"] for m in replies] == ["You are a pirate.", "You are a parrot."]


def test_an_export_names_the_templates_own_system_prompt_and_says_nothing_it_does_not_know():
    conv = SimpleNamespace(title="T")
    msg = lambda role, content, stats=None: SimpleNamespace(role=role, content=content, stats=stats or {})  # noqa: E731
    settings = {"model": "SmolLM2", "system_prompt": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                "system_prompt_from": "template", "temperature": 0.0}
    md = conversation_markdown(conv, [msg("user", "Hi"), msg("assistant", "Hello!", {"settings": settings})])
    assert "_The model's chat template's own system prompt (none was set):_\n\nYou are a helpful AI" in md
    assert "_Settings: model SmolLM2 · temperature 0_" in md
    old = conversation_markdown(conv, [msg("user", "Hi"), msg("assistant", "Hello!", {"completion_tokens": 2})])
    assert old == "# T\n\n## You\n\nHi\n\n## Assistant\n\nHello!\n"   # replies saved before settings were kept


@pytest.fixture
def documents(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setattr(file_dialogs, "_last_dir", None)
    asked = []
    monkeypatch.setattr(file_dialogs.QFileDialog, "getSaveFileName",
                        staticmethod(lambda parent, title, start, kinds: (asked.append(start), ("", ""))[1]))
    return home / "Documents", asked


def test_save_dialogs_start_in_the_documents_folder(qtbot, make_window, documents, tmp_path, monkeypatch):
    folder, asked = documents
    monkeypatch.chdir(tmp_path)   # a source checkout, say
    w = make_window()
    reply(qtbot, w, "Hello")
    w.export_dialog(w.current_conversation, "markdown")
    w.panels["attentionPanel"].widget()._export_png_dialog()
    # It started in the current directory.
    assert asked[0] == os.path.join(str(folder), "Hello.md")
    assert os.path.dirname(asked[1]) == str(folder) and asked[1].endswith(".png")


@pytest.mark.parametrize("unit, budget, flag, said", [("tokens", 512.0, "512", "h2o cache policy (512 tokens)"),
                                                      ("MiB", 1.5, "1.5MiB", "h2o cache policy (1.5 MiB)")])
def test_the_server_gets_the_windows_cache_policy(qtbot, make_window, unit, budget, flag, said):
    """The cache policy set in Edit > Settings > Cache policy reaches the server the toggle
    starts (its flags and the menu entry's text); without it that server would keep every token
    (its default, none). With the policy none, no flag is added."""
    w = make_window()
    for key, value in (("generation/cache_policy", "h2o"), ("generation/cache_budget", budget),
                       ("generation/cache_budget_unit", unit)):
        w.settings.set(key, value)
    options = w.serve_toggle.options()
    assert options["cache_policy"] == "h2o" and options["cache_budget"] == flag
    _, args = serve_command("/m/fake.gguf", "cpu", **options)
    assert args[args.index("--cache-policy") + 1] == "h2o" and args[args.index("--cache-budget") + 1] == flag
    assert said in w.serve_toggle.settings_action.text()
    w.settings.set("generation/cache_policy", "none")   # none: nothing added
    assert "cache_policy" not in w.serve_toggle.options()
    assert "--cache-policy" not in serve_command("/m/fake.gguf", "cpu", **w.serve_toggle.options())[1]
