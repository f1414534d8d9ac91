"""What the command line says to the flags and names people try: chat's options on the app
(``attnchat --terminal --max-new-tokens 12``), an unknown flag of a command (its own help, the
nearest option), a misspelt catalog id (the nearest id, ``models list``), and a one-shot
reply that stopped at a limit.

The argument cases run in-process (``attnchat.cli.main``), stopping where the model would
load: a dispatch would otherwise cost a model load each.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnchat import cli
from attnchat.cli import chat as chat_cmd


@pytest.fixture
def main(monkeypatch, capsys, tmp_path):
    """``main(*argv) -> (status, stdout, stderr, chat_args)``: ``chat_args`` is the namespace the
    terminal chat would have run with (None when it was not reached)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    seen = []
    monkeypatch.setattr(chat_cmd, "run", lambda args: seen.append(args) or 0)

    def call(*argv: str):
        try:
            status = cli.main(list(argv))
        except SystemExit as e:
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err, (seen[-1] if seen else None)

    return call


def test_chat_options_on_the_terminal_app_run_the_terminal_chat_with_them(main):
    status, _, err, args = main("--terminal", "--max-new-tokens", "12")
    assert (status, err) == (0, "")
    assert args.command == "chat" and args.prompt == [] and args.max_new_tokens == 12
    status, _, err, args = main("--model", "m.gguf", "--temperature=0.5", "--terminal", "--device", "cpu")
    assert (status, err) == (0, "")
    assert (args.model, args.temperature, args.device, args.max_new_tokens) == ("m.gguf", 0.5, "cpu", 512)


def test_a_chat_option_given_to_the_window_says_where_it_belongs(main):
    status, _, err, args = main("--max-new-tokens", "12")
    assert status == 2 and args is None
    assert err.startswith("attnchat: error: --max-new-tokens is an option of the terminal chat, not the window: "
                          "`attnchat --terminal --max-new-tokens 12`; the window has it in Edit > Settings")
    assert err.count("\n") == 1 and "invalid choice" not in err


def test_a_chat_option_given_to_the_self_test_is_one_line(main):
    status, _, err, _ = main("--self-test", "--max-new-tokens", "3")
    assert status == 2 and err.count("\n") == 1
    assert "--max-new-tokens is an option of the terminal chat; --self-test and --screenshot take only" in err


@pytest.mark.parametrize("argv, line", [
    (["chat", "--bogus"], "attnchat: error: unrecognized arguments: --bogus (see attnchat chat --help)\n"),
    (["chat", "--prompt", "hi", "--max-tokens", "5"],
     "attnchat: error: unrecognized arguments: --max-tokens 5; did you mean --max-new-tokens? "
     "(see attnchat chat --help)\n"),
    (["models", "list", "--bogus"], "attnchat: error: unrecognized arguments: --bogus (see attnchat models list --help)\n"),
    (["serve", "--prot", "8000"],
     "attnchat: error: unrecognized arguments: --prot 8000; did you mean --port? (see attnchat serve --help)\n"),
    (["--bogus"], "attnchat: error: unrecognized arguments: --bogus (see attnchat --help)\n"),
    (["chat", "--terminal"], "attnchat: error: unrecognized arguments: --terminal; `attnchat chat` without --prompt "
                             "is the terminal chat (or `attnchat --terminal`) (see attnchat chat --help)\n"),
    (["--terminal", "--bogus"], "attnchat: error: unrecognized arguments: --bogus (see attnchat chat --help)\n"),
])
def test_an_unknown_flag_points_at_its_commands_help(main, argv, line):
    status, out, err, args = main(*argv)
    assert (status, out, err, args) == (2, "", line, None)


@pytest.mark.parametrize("name, guess", [
    ("qwen2.5-0.5b-instruct-typo", "did you mean qwen2.5-0.5b-instruct? "),
    ("Gemma-3-1B", "did you mean gemma-3-1b-it? "),
    ("llama", "did you mean llama-3.2-1b-instruct or llama-3.2-3b-instruct? "),
    ("zzz", ""),
])
def test_a_misspelt_catalog_id_names_the_nearest_and_models_list(monkeypatch, capsys, tmp_path, name, guess):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)  # no file of that name here
    status = cli.main(["chat", "--model", name, "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2
    assert err == (f"attnchat: error: {name} is not a file, a model folder or a catalog id; {guess}`attnchat "
                   "models list` shows the catalog's ids (or give a .gguf file, a model folder or "
                   "hf.co/OWNER/REPO:QUANT)\n")


def test_a_missing_path_is_still_the_loaders_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    status = cli.main(["chat", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2 and "nope does not exist" in err and "catalog id" not in err


@pytest.mark.slow
def test_a_one_shot_reply_cut_at_a_limit_says_so_on_stderr(default_model, monkeypatch, capsys, tmp_path):
    """The default model, greedy: 5 tokens of a story stop at the length limit; at a 64-token
    context the reply fills it; the capital of France ends by itself (no note)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(chat_cmd, "_load", lambda args: default_model)
    story = "Tell me a story about a dragon."

    assert cli.main(["chat", "--max-new-tokens", "5", "--prompt", story]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and out.strip()
    assert err == ("attnchat: note: the reply stopped at the length limit (5 tokens); "
                   "raise --max-new-tokens for a longer one\n")

    assert cli.main(["chat", "--context", "64", "--max-new-tokens", "100", "--prompt", story]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert err == "attnchat: note: the reply stopped because the context (64 tokens) is full; give a longer --context\n"

    assert cli.main(["chat", "--max-new-tokens", "64", "--prompt", "What is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and err == ""


def test_chat_and_serve_say_the_same_about_the_model_options():
    """serve's --dtype help said float16 was the CPU default long after GGUF files came to run from
    their own blocks (chat's said so)."""
    commands = cli.build_parser().commands

    def helps(name):
        return {o: a.help for a in commands[name]._actions for o in a.option_strings
                if o in ("--model", "--device", "--dtype", "--reproducible")}

    assert helps("chat") == helps("serve") and len(helps("serve")) == 4
    assert helps("serve")["--dtype"].startswith("weights: a quantized GGUF runs from its own blocks by default (gguf)")


def test_memory_says_its_sizes_in_binary_units_only(monkeypatch, capsys, tmp_path):
    """One convention on the command line (models.sizes): the planner's notes said "~280 MB"
    beside its MiB figures."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert cli.main(["memory"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^KV bytes at 8,192 tokens +188,743,680 \(180\.0 MiB\)$", out, re.M), out
    assert "~270 MiB RSS measured here" in out and " MB" not in out and " GB" not in out


def test_models_fetch_of_a_misspelt_id_names_the_nearest(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert cli.main(["models", "fetch", "qwen2.5-0.5b-instruct-typo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnchat: error: unknown model 'qwen2.5-0.5b-instruct-typo'; did you mean "
                          "qwen2.5-0.5b-instruct? known models: smollm2-135m-instruct, ") and err.count("\n") == 1


def test_the_readme_names_the_options_serve_takes():
    """The README said most of chat's options apply to serve; serve takes a few (--max-new-tokens
    there is unrecognized: its requests give max_tokens)."""
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"`serve` takes (.*?): `attnchat serve --help`\)", readme).group(1)
    named = re.findall(r"`(--[a-z-]+)`", said)
    serve = {o for a in cli.build_parser().commands["serve"]._actions for o in a.option_strings}
    assert named == ["--model", "--temperature", "--context", "--cache-dtype", "--overflow", "--device", "--dtype",
                     "--reproducible", "--max-tokens"]
    assert set(named) <= serve and {"--cache-policy", "--cache-budget"} <= serve
    assert "--max-new-tokens" not in serve and "--system" not in serve


def test_the_cache_dtype_default_is_said_as_the_app_takes_it(monkeypatch, capsys, tmp_path):
    """memory's --help said the CPU's default cache was float32 while memory (and chat, and the
    server) gave the default GGUF a float16 one; chat's and serve's help named no default."""
    from attnchat.model_options import CACHE_DTYPE_HELP
    from runtime.device import default_cache_dtype
    from runtime.memory.sizes import cache_bytes_per_token

    commands = cli.build_parser().commands
    for name in ("chat", "serve", "memory"):
        assert {a.help for a in commands[name]._actions if "--cache-dtype" in a.option_strings} == {CACHE_DTYPE_HELP}
    assert ("default: for a GGUF run from its own blocks on the CPU (the default model) float16, or bfloat16 or "
            "float32 where this machine reads it much faster at the model's head size (timed once)") in CACHE_DTYPE_HELP
    assert str(default_cache_dtype("cpu", "float32", blocks=True)) == "torch.float16"
    assert str(default_cache_dtype("cpu", "float32")) == "torch.float32"  # "else ... float32 on the CPU"

    per_token = cache_bytes_per_token(30, 3, 64, "float16")
    assert per_token == 23_040 and cache_bytes_per_token(30, 3, 64, "float32") == 46_080
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert cli.main(["memory"]) == 0
    assert re.search(r"^KV bytes per token +23,040 \(float16\)$", capsys.readouterr().out, re.M)
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    assert (f"The default model's cache takes 2 x 30 x 3 x 64 x 2 = {per_token:,} bytes per token in float16, "
            "its default (a GGUF's blocks on the CPU; 46,080 in float32). Where this machine's attention reads "
            "another dtype faster at the model's head size (timed once, kept), the app takes it instead") in readme
    assert f"16 tokens a page, {16 * per_token:,} bytes for the default model in its float16 cache" in readme


def test_an_unknown_flag_after_terminal_is_named_by_chats_parser(main):
    """``--terminal`` takes chat's options, but an unknown one pointed at ``attnchat --help`` (which
    lists none of them) with no near option."""
    status, _, err, args = main("--terminal", "--max-tokens", "5")
    assert (status, args) == (2, None)
    assert err == ("attnchat: error: unrecognized arguments: --max-tokens; did you mean --max-new-tokens? "
                   "(see attnchat chat --help)\n")
    status, _, err, _ = main("--bogus")
    assert status == 2 and err == "attnchat: error: unrecognized arguments: --bogus (see attnchat --help)\n"


def _named_fields(text: str) -> dict:
    """``a, b{c, d{e}}`` -> ``{"a": {}, "b": {"c": {}, "d": {"e": {}}}}`` (the README's field lists)."""
    root: dict = {}
    stack, name = [root], ""
    for ch in text + ",":
        if ch not in ",{}":
            name += ch
            continue
        if name.strip():
            stack[-1][name.strip()] = {}
        if ch == "{":
            stack.append(stack[-1][name.strip()])
        elif ch == "}":
            stack.pop()
        name = ""
    return root


def _keys(obj: dict) -> dict:
    return {k: _keys(v) if isinstance(v, dict) else {} for k, v in obj.items()}


@pytest.mark.slow
def test_the_readme_names_every_field_chat_json_prints(monkeypatch, capsys, tmp_path):
    """The README's list of `chat --json`'s fields had lost nine of them (evicted_tokens, the
    thread counts, the rolling policy's, cache_dtype; kv_cache's positions, evicted_tokens, full_bytes)."""
    import json

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert cli.main(["chat", "--json", "--max-new-tokens", "2", "--prompt", "Hi"]) == 0
    printed = json.loads(capsys.readouterr().out)
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"`chat --json` prints one JSON object per turn: `([^`]+)`", readme)
    assert said, "the README's chat --json sentence is gone or reworded: update this test with it"
    assert _named_fields(said.group(1)) == _keys(printed)
    assert printed["kv_cache"]["bytes_per_token"] == 23_040 and printed["cache_dtype"] == "float16"
