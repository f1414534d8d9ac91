"""The command line, in-process (``attnchat.cli.main``): more user errors (exit 2, one line, no
traceback, checked before the slow load where they can be) and the unexpected-error path
(exit 1, one line naming the log file, the traceback in that file)."""
from __future__ import annotations

import pytest
import torch

from attnchat import cli
from attnchat.cli import chat as chat_cmd

LIBRARY_ENV = ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY",
               "TOKENIZERS_PARALLELISM")


@pytest.fixture
def run(monkeypatch, log_dir, capsys):
    """``run(*argv) -> (status, stdout, stderr)``; the environment the CLI sets is put back after."""
    for name in LIBRARY_ENV:
        monkeypatch.setenv(name, "1" if name != "TRANSFORMERS_VERBOSITY" else "error")

    def call(*argv):
        status = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return status, out, err

    return call


def one_line_error(status, out, err, *words) -> str:
    assert status == 2, (status, err)
    assert err.startswith("attnchat: error: ") and err.count("\n") == 1 and err.endswith("\n"), repr(err)
    assert "Traceback" not in err and out == ""
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_is_not_sent(run, tmp_path, prompt):
    err = one_line_error(*run("chat", "--prompt", "hi", "--prompt", prompt, "--model", tmp_path / "missing.gguf"),
                         "empty", "--prompt")
    assert "missing.gguf" not in err   # refused before the model is looked at


@pytest.mark.parametrize("args, words", [
    (["--context", "-5"], ["context", "-5"]),
    (["--cache-limit-mib", "-1"], ["KV-cache limit", "positive"]),
    (["--cache-dtype", "float8"], ["float8", "float32"]),
])
def test_bad_arguments_before_the_load(run, tmp_path, args, words):
    err = one_line_error(*run("chat", "--prompt", "hi", *args, "--model", tmp_path / "missing.gguf"), *words)
    assert "missing.gguf" not in err


@pytest.mark.parametrize("args, words", [
    (["--context", "500"], ["500", "maximum of 128"]),
    (["--cache-limit-mib", "0.0001"], ["smaller than one token", "raise the limit"]),
    (["--context", "8"], ["the message needs", "context holds 8", "shorten"]),
])
def test_arguments_that_do_not_fit_the_model(run, tiny_folder, args, words):
    one_line_error(*run("chat", "--prompt", "the a and", "--model", tiny_folder, "--device", "cpu", *args), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_that_is_not_here_exits_2(run, tiny_folder):
    one_line_error(*run("chat", "--prompt", "hi", "--model", tiny_folder, "--device", "cuda:7"), "cuda:7",
                   "not available")


def test_a_good_run_of_the_same_model(run, tiny_folder):
    """The control for the cases above."""
    status, out, err = run("chat", "--prompt", "the a and", "--model", tiny_folder, "--device", "cpu",
                           "--max-new-tokens", "3", "--context", "100")
    # a random tiny model never ends by itself: its reply stops at the limit, and says so
    assert status == 0 and out.strip()
    assert err == "attnchat: note: the reply stopped at the length limit (3 tokens); raise --max-new-tokens for a longer one\n"


def test_an_unexpected_error_is_one_line_and_its_traceback_goes_to_the_log(run, log_dir, monkeypatch):
    def broken(args):
        raise RuntimeError("something internal broke\nwith a second line of detail")

    monkeypatch.setattr(chat_cmd, "run", broken)
    status, out, err = run("chat", "--prompt", "hi")
    log_file = log_dir / "attnchat.log"
    assert status == 1 and out == ""
    assert err == f"attnchat: internal error: RuntimeError: something internal broke; details in {log_file}\n"
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "in broken" in text
    assert "RuntimeError: something internal broke" in text and "with a second line of detail" in text


def test_a_user_error_is_logged_too_but_shown_in_one_line(run, log_dir, tmp_path):
    status, out, err = run("chat", "--prompt", "hi", "--model", tmp_path / "nowhere.gguf")
    one_line_error(status, out, err, "nowhere.gguf", "does not exist")
    assert "nowhere.gguf" in (log_dir / "attnchat.log").read_text()


def test_a_full_context_with_overflow_stop_is_one_line_not_an_empty_reply(run, tiny_folder):
    """Turn 1's reply fills the 40-token context; turn 2 has no room (it printed an empty reply, exit 0)."""
    import json

    status, out, err = run("chat", "--model", tiny_folder, "--device", "cpu", "--prompt", "the cat",
                           "--prompt", "and the dog", "--context", "40", "--overflow", "stop",
                           "--max-new-tokens", "40", "--temperature", "0", "--json")
    turns = [json.loads(line) for line in out.splitlines()]
    assert len(turns) == 1 and turns[0]["text"] and turns[0]["finish_reason"] == "context"   # turn 1 only
    assert status == 2 and err.startswith("attnchat: error: the context is full") and err.count("\n") == 1, err
    for words in ("of its 40 tokens", "no room for a reply to --prompt 2", "--context", "--overflow truncate-middle"):
        assert words in err, (words, err)
