"""The memory planner's arithmetic, and `attnchat memory`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.config.model import ModelConfig
from runtime.memory.planner import count_parameters, plan, plan_for_config
from runtime.memory.sizes import kv_bytes_per_token
from tests.hang import HANG_S


def test_worked_example_32_layers_8_kv_heads_128_dims_2_bytes():
    p = plan(layers=32, kv_heads=8, head_dim=128, cache_dtype="bfloat16", context=100_000)
    assert p.kv_bytes_per_token == 131_072
    assert p.kv_bytes == 13_107_200_000
    assert 12.2 < p.kv_bytes / 2**30 < 12.21  # "about 12 GiB"


def test_default_model_float32_is_46080_bytes_per_token():
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080


@pytest.mark.parametrize("budget,expected", [(0, 0), (46_079, 0), (46_080, 1), (100 * 2**20, 2275)])
def test_max_context_in_budget_is_whole_tokens(budget, expected):
    p = plan(layers=30, kv_heads=3, head_dim=64, cache_dtype="float32", context=10, budget_bytes=budget)
    assert p.max_context_in_budget == expected


def test_bad_numbers_raise():
    with pytest.raises(ValueError, match="layers must be positive"):
        plan(layers=0, kv_heads=1, head_dim=1, context=1)
    with pytest.raises(ValueError, match="context"):
        plan(layers=1, kv_heads=1, head_dim=1, context=0)
    with pytest.raises(ValueError, match="unknown cache dtype"):
        plan(layers=1, kv_heads=1, head_dim=1, context=1, cache_dtype="int3")
    with pytest.raises(ValueError, match="unknown weights dtype 'int3'"):
        plan_for_config(ModelConfig(family="llama", model_type="llama", vocab_size=10, hidden_size=8, n_layers=1,
                                    n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                                    max_position_embeddings=32, norm_eps=1e-5), context=1, weights_dtype="int3")


@pytest.mark.slow
def test_parameter_count_matches_the_loaded_default_model(default_model):
    loaded = sum(p.numel() for p in default_model.decoder.parameters())
    assert count_parameters(default_model.config) == loaded
    p = plan_for_config(default_model.config, context=8192, weights_dtype="float32")
    assert p.weights_bytes == default_model.weights_bytes
    assert p.kv_bytes == 8192 * 46_080
    assert p.total_bytes == p.weights_bytes + p.kv_bytes + p.tokenizer_bytes + p.turn_bytes
    # The CPU's default weights are float16 (runtime.device.default_dtype), norms kept in float32
    vectors = sum(m.weight.numel() for m in default_model.decoder.modules() if type(m).__name__ == "Norm")
    assert plan_for_config(default_model.config, context=8192).weights_bytes == default_model.weights_bytes // 2 + 2 * vectors


@pytest.mark.parametrize("family,dtype", [("llama", "float16"), ("gpt2", "float16"), ("gemma3", "bfloat16"),
                                          ("gemma3", "int8"), ("gpt2", "int8")])
def test_the_planners_weights_are_what_the_loader_keeps(tmp_path, family, dtype):
    """Norm weights and biases stay in the compute dtype (float32 on the CPU): the planner
    counts them so, not at the weights' 2 bytes."""
    from runtime import load_model
    from runtime.memory.planner import weights_bytes
    from tests.runtime.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, family), device="cpu", dtype=dtype)
    assert weights_bytes(model.config, dtype) == model.weights_bytes


def test_the_plan_counts_the_tokenizer_and_a_turn_and_says_what_it_leaves_out():
    """Gemma 3 270M's 262,144-entry tokenizer held 325 MB (scripts/memory_stages.py): the total
    counted only weights and KV cache before."""
    from runtime.memory.planner import tokenizer_bytes

    gemma = ModelConfig(family="llama", model_type="gemma3_text", vocab_size=262_144, hidden_size=640, n_layers=18,
                        n_heads=4, n_kv_heads=1, head_dim=256, intermediate_size=2048,
                        max_position_embeddings=32_768, norm_eps=1e-6, tie_word_embeddings=True)
    p = plan_for_config(gemma, context=4096)
    assert 300e6 < p.tokenizer_bytes == tokenizer_bytes(262_144) < 340e6
    assert p.turn_bytes > 2 * 262_144 * 4
    assert p.total_bytes == p.weights_bytes + p.kv_bytes + p.tokenizer_bytes + p.turn_bytes
    assert any("Python" in s for s in p.leaves_out)


def test_memory_command_with_numbers(attnchat_cli):
    status, out, err = attnchat_cli("memory", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                    "--cache-dtype", "bfloat16", "--context", "100000", "--budget-mib", "1024", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 131_072
    assert data["kv_bytes"] == 13_107_200_000
    assert data["max_context_in_budget"] == 8192
    assert data["weights_bytes"] is None


def test_memory_command_under_a_cache_policy():
    out = subprocess.run(
        [sys.executable, "-P", "-m", "attnchat", "memory", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
         "--cache-dtype", "float32", "--context", "8192", "--cache-policy", "h2o", "--cache-budget", "1MiB", "--json"],
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cache_budget"] == 2**20 // 46_080 == 22 and data["kv_bytes"] == 22 * 46_080


@pytest.mark.slow
def test_memory_command_on_the_default_model(default_model_file, default_model, attnchat_cli):
    status, out, err = attnchat_cli("memory", "--model", str(default_model_file), "--cache-dtype", "float16",
                                    "--context", "1000", "--budget-mib", "10", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 23_040
    assert data["kv_bytes"] == 23_040_000
    assert data["max_context_in_budget"] == 10 * 2**20 // 23_040
    # A quantized GGUF runs from its own blocks by default: its weights are the
    # file's tensors at their size, named by the file's quantization.
    from runtime.weights.gguf.mmap import read_gguf_tensors

    tensors = read_gguf_tensors(default_model_file).tensors.values()
    assert data["weights_dtype"] == "Q4_1"
    assert data["weights_bytes"] == sum(i.nbytes for i in tensors) < default_model_file.stat().st_size
    assert data["weights_bytes"] < default_model.weights_bytes / 4  # float32: 538 MB; the blocks ~98 MB


@pytest.mark.slow
def test_memory_command_weights_dtype_widens(default_model_file, default_model, capsys):
    status, out, err = _memory(capsys, "--model", str(default_model_file), "--weights-dtype", "float16",
                               "--context", "1000", "--json")
    assert status == 0, err
    data = json.loads(out)
    # float16, the norm weights kept in float32 (the loaded model's 269,100,288)
    vectors = sum(m.weight.numel() for m in default_model.decoder.modules() if type(m).__name__ == "Norm")
    assert data["weights_bytes"] == default_model.weights_bytes // 2 + 2 * vectors
    assert data["weights_dtype"] == "float16"


def test_memory_command_half_given_numbers_exit_2():
    out = subprocess.run([sys.executable, "-m", "attnchat", "memory", "--layers", "3", "--context", "5"],
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "give all three" in out.stderr


def _memory(capsys, *args: str) -> tuple[int, str, str]:
    from attnchat import cli

    status = cli.main(["memory", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def _rows(out: str) -> dict[str, str]:
    """The table's rows, label -> value (columns are two or more spaces apart)."""
    import re

    return dict(re.split(r"\s{2,}", ln.strip(), maxsplit=1) for ln in out.splitlines() if ln.strip())


SHAPE = ("--layers", "30", "--kv-heads", "3", "--head-dim", "64")


def test_a_device_this_machine_lacks_is_planned_for_with_its_defaults(capsys, monkeypatch):
    """CUDA computes in float16 and its cache takes that dtype: half the CPU's bytes per token,
    whether or not this machine has CUDA (it is hidden here so a GPU machine agrees)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = _memory(capsys, *SHAPE, "--device", "cuda", "--context", "100")
    assert status == 0, err
    rows = _rows(out)
    assert rows["KV bytes per token"] == "23,040 (float16)"
    assert rows["device"] == "cuda: not on this machine (no CUDA here); planned for its defaults, free memory unknown"
    assert not [k for k in rows if k.startswith("free memory")]
    status, out, _ = _memory(capsys, *SHAPE, "--device", "cuda", "--context", "100", "--json")
    data = json.loads(out)
    assert (data["kv_bytes_per_token"], data["cache_dtype"], data["device_here"], data["free_device_bytes"]) == \
        (23_040, "float16", False, None)
    status, out, _ = _memory(capsys, *SHAPE, "--device", "cpu", "--context", "100", "--json")
    assert (json.loads(out)["kv_bytes_per_token"], json.loads(out)["device_here"]) == (46_080, True)


def test_absurd_contexts_and_unknown_devices_are_one_line(capsys):
    status, out, err = _memory(capsys, *SHAPE, "--context", "1000000000000")
    assert status == 2 and not out
    assert err == "attnchat: error: --context 1,000,000,000,000 is past any model's reach; give at most " \
                  "1,000,000,000 tokens\n"
    status, _, err = _memory(capsys, *SHAPE, "--context", "10", "--device", "tpu")
    assert status == 2 and err.count("\n") == 1 and "unknown device 'tpu'" in err


def test_one_kv_head_is_singular(capsys):
    status, out, _ = _memory(capsys, "--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--context", "10")
    assert "2 layers x 1 KV head x 4" in out and "multi-query (1 KV head)" in out and "KV heads" not in out


@pytest.mark.slow
def test_a_context_past_the_model_says_where_it_stops(capsys, default_model_file):
    status, out, err = _memory(capsys, "--model", str(default_model_file), "--context", "100000", "--budget-mib", "10000")
    assert status == 0, err
    rows = _rows(out)
    assert rows["KV bytes at 100,000 tokens"] == "2,304,000,000 (2,197.3 MiB) (the model stops at 8,192)"
    assert rows["longest context in 10000 MiB"] == "455,111 tokens (the model stops at 8,192)"


def test_a_cache_policy_budget_bounds_the_planned_cache():
    """The planner ignored a cache policy's budget: a 256-token h2o budget at 8,192 tokens was
    planned as the whole 360 MiB cache while the cache never holds more than 256 tokens."""
    from models.kv_bytes import UNBOUNDED

    full = plan(layers=30, kv_heads=3, head_dim=64, cache_dtype="float32", context=8192)
    p = plan(layers=30, kv_heads=3, head_dim=64, cache_dtype="float32", context=8192, cache_budget=256,
             budget_bytes=20 * 2**20)
    assert full.kv_bytes == 8192 * 46_080 and p.kv_bytes == 256 * 46_080 and p.cache_budget == 256
    assert p.layer_types[0]["tokens"] == 256 and p.max_context_in_budget == UNBOUNDED   # 11.25 MiB fits 20
    short = plan(layers=30, kv_heads=3, head_dim=64, cache_dtype="float32", context=100, cache_budget=256)
    assert short.kv_bytes == 100 * 46_080   # below the budget nothing is evicted
    # In bytes: 1 MiB of the whole cache; Gemma-like windows are held whole beside the budget.
    w = plan(layers=3, kv_heads=1, head_dim=16, cache_dtype="float32", context=5000, windows=[8, 8, None],
             cache_budget_bytes=128 * (2 * 8 + 20))
    assert w.cache_budget == 20 and w.kv_bytes == 128 * (2 * 8 + 20)
    assert plan(layers=3, kv_heads=1, head_dim=16, cache_dtype="float32", context=5000, cache_budget=30,
                cache_budget_bytes=128 * 3 * 20).cache_budget == 20   # the smaller of the two
    with pytest.raises(ValueError, match="at least one token"):
        plan(layers=3, kv_heads=1, head_dim=16, cache_dtype="float32", context=50, windows=[8, 8, None],
             cache_budget_bytes=128 * 16)


def test_the_planned_policy_cache_is_what_a_session_holds(tmp_path):
    """The plan under a policy is the most the session's cache holds, to the byte, a long prompt
    read past the budget (between evictions it holds less: the budget is a ceiling)."""
    from runtime import ChatSession, GenerationSettings, load_model
    from tests.runtime.tiny_models import WORDS, make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama", max_positions=1024), device="cpu", dtype="float32")
    st = GenerationSettings(max_new_tokens=1, context_limit=1024, cache_policy="sinks-window", cache_budget=64,
                            overflow="stop", prefill_chunk=32)
    s = ChatSession(model, settings=st)
    used = [s.cache.used_bytes for _ in s.send(" ".join(WORDS * 2))]
    c = model.config
    p = plan(layers=c.n_layers, kv_heads=c.n_kv_heads, head_dim=c.head_dim, cache_dtype="float32",
             context=s.cache.length, cache_budget=64)
    assert s.cache.length > 64 + 16 and p.kv_bytes == max(used) == 64 * 512 >= s.cache.used_bytes
