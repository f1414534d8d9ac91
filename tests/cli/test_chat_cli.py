"""``attnchat chat`` on the real default model: JSON Lines per turn, prefix reuse across
turns, the rolling policy at a 128-token context, and a message too long for the context.

Each case is one run of the command line's ``main`` in this process (tests/in_process.py: a
process of its own spent ~15 s importing and loading; the entry point as a process is
tests/cli/test_cli_errors.py's).
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from runtime.generate.chat_format import Message, encode_messages
from tests.in_process import cli_in_process

pytestmark = pytest.mark.slow

TURNS = ["What is the capital of France?", "And what is the capital of Italy?"]
SETTING = (
    "Here is the setting of my story: a small fishing village by a cold northern sea, where a "
    "young girl called Mira lives with her grandmother, a retired sailor who tells tales of sea "
    "monsters. One winter night a storm wrecks a strange ship on the rocks. Write the story of "
    "what Mira finds on the ship."
)
HUGE = "Please summarise this. " + "The quick brown fox jumps over the lazy dog. " * 10
ROLLING_NEW_TOKENS = 40

CASES = {
    "two-turns": ["--prompt", TURNS[0], "--prompt", TURNS[1], "--json", "--max-new-tokens", "8"],
    "rolling": ["--prompt", SETTING, "--prompt", "What did Mira find?", "--json", "--context", "128",
                "--overflow", "rolling", "--max-new-tokens", str(ROLLING_NEW_TOKENS)],
    "too-long": ["--prompt", HUGE, "--context", "64", "--json"],
}


@pytest.fixture(scope="module")
def results(default_model_file, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    state = tmp_path_factory.mktemp("state")
    return {name: cli_in_process(["chat", "--model", str(default_model_file), *args], state)
            for name, args in CASES.items()}


def _turns(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    return [json.loads(line) for line in lines]


def test_two_prompts_print_two_json_lines_and_reuse_the_cache(results, default_tokenizer):
    turns = _turns(results["two-turns"])
    assert len(turns) == 2
    t1, t2 = turns
    for t in turns:
        assert t["finish_reason"] in ("stop", "length") and t["text"]
        assert t["prefilled_tokens"] == t["prompt_tokens"] - t["reused_tokens"]
        assert t["kv_cache"]["bytes_per_token"] == 23_040 and t["model"].startswith("SmolLM2-135M-Instruct")
        # The default for a quantized GGUF: its own blocks (named as llama.cpp names the file's
        # type), computing in float32 on the CPU, caching keys and values in float16.
        assert (t["device"], t["dtype"], t["compute_dtype"], t["kv_cache"]["dtype"]) == ("cpu", "Q4_1", "float32", "float16")
    assert t1["reused_tokens"] == 0
    # Turn 2 reuses turn 1's prompt and whole reply from the cache (a length stop feeds its
    # last token too), and prefills only the template's end-of-turn and the new message.
    assert t2["reused_tokens"] == t1["prompt_tokens"] + t1["completion_tokens"]
    new_part = default_tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{TURNS[1]}<|im_end|>\n<|im_start|>assistant\n",
                                        add_special_tokens=False)
    assert t2["prefilled_tokens"] == len(new_part)
    assert t2["kv_cache"]["tokens"] == t2["prompt_tokens"] + t2["completion_tokens"]


def test_rolling_at_a_128_token_context(results):
    turns = _turns(results["rolling"])
    assert len(turns) == 2
    t1, t2 = turns
    for t in turns:
        assert t["context_limit"] == 128 and t["kv_cache"]["tokens"] <= 128
        assert t["finish_reason"] in ("stop", "length") and t["text"].strip()
        assert t["prefilled_tokens"] == t["prompt_tokens"] - t["reused_tokens"]
    # Turn 1's reply went past the window; turn 2's prompt alone is longer than the context.
    assert t1["completion_tokens"] == ROLLING_NEW_TOKENS > 128 - t1["prompt_tokens"]
    assert t2["prompt_tokens"] > 128 and t2["reused_tokens"] > 0


def test_a_message_longer_than_the_context_exits_2_with_one_line(results, default_tokenizer):
    r = results["too-long"]
    need = len(encode_messages(default_tokenizer, [Message("user", HUGE)]))
    assert need > 64
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("attnchat: error:")
    assert re.findall(r"\d+", lines[0]) == [str(need), "64"], lines[0]
