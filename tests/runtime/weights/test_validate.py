"""runtime.weights.validate: poisoned GGUFs (gguf's own writer, a tiny file's tensors) are
refused in one line naming the key or the tensor, by every path that reads a model: the
load (chat, serve), ``attnchat memory`` and the Hub's header check; no library warning
reaches the terminal."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import ModelLoadError
from runtime.weights import validate
from tests.runtime.poisoned_gguf import nan_scales, relabel_in_place, rewrite
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

ENTRY = Path(sys.executable).parent / "attnchat"
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Q4_K = 144


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny"), tokenizer=tiny_tokenizer_metadata())


#: name -> (how the file is poisoned, words the one line holds)
POISONS = {
    "layers": (dict(metadata={"llama.block_count": 1_000_000}), "llama.block_count = 1,000,000"),
    "heads0": (dict(metadata={"llama.attention.head_count": 0}), "llama.attention.head_count = 0"),
    "embd0": (dict(metadata={"llama.embedding_length": 0}), "llama.embedding_length = 0"),
    "kv3": (dict(metadata={"llama.attention.head_count_kv": 3}), "must be a multiple of the key/value heads"),
    "vocab": (dict(shapes={"token_embd.weight": (100, 256)}), "'token_embd.weight' has shape 100 x 256 where"),
    "down": (dict(shapes={"blk.0.ffn_down.weight": (256, 256)}), "'blk.0.ffn_down.weight' has shape 256 x 256 where"),
    "zero_rows": (dict(shapes={"blk.1.attn_k.weight": (0, 256)}), "'blk.1.attn_k.weight' has shape 0 x 256, with no elements"),
    "missing": (dict(drop=("blk.1.ffn_up.weight",)), "no tensor 'blk.1.ffn_up.weight'"),
    "nan_one": (dict(blocks={"blk.1.attn_q.weight": nan_scales(Q4_K)}), "'blk.1.attn_q.weight' (Q4_K) has NaN or infinite scales"),
    "inf_all": (dict(blocks={f"blk.{i}.{m}.weight": nan_scales(Q4_K, value=float("inf"))
                             for i in range(2) for m in MATRICES if m != "ffn_down"}), "'blk.0.attn_q.weight' (Q4_K)"),
    "dmin_nan": (dict(blocks={"blk.0.ffn_up.weight": nan_scales(Q4_K, at=2)}), "'blk.0.ffn_up.weight' (Q4_K) has NaN"),
    "norm_nan": (dict(blocks={"output_norm.weight": lambda raw: _f32_nan(raw)}), "'output_norm.weight' (F32) has NaN or infinite values"),
    "relabel": (dict(types={"blk.0.ffn_up.weight": "IQ4_XS"}), "'blk.0.ffn_up.weight' (IQ4_XS) has NaN or infinite scales"),
    "relabel_up": (dict(types={"blk.0.attn_q.weight": "Q5_K"}), "'blk.0.attn_q.weight' (Q5_K) has NaN or infinite"),
    "relabel_header": (None, "tensors 'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' share bytes"),
}


def _f32_nan(raw: np.ndarray) -> np.ndarray:
    raw.reshape(-1).view(np.float32)[7] = np.nan
    return raw


@pytest.fixture(scope="module")
def poisoned(tiny, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("poisoned")
    out = {name: rewrite(tiny, folder / f"{name}.gguf", **how) for name, (how, _) in POISONS.items() if how}
    out["relabel_header"] = relabel_in_place(tiny, folder / "relabel_header.gguf", "blk.0.attn_q.weight", "Q5_K")
    return out


def test_the_rewriter_is_faithful(tiny, tmp_path):
    assert rewrite(tiny, tmp_path / "same.gguf").read_bytes() == tiny.read_bytes()
    validate.check_gguf(tmp_path / "same.gguf")


@pytest.mark.parametrize("name", POISONS)
def test_each_poison_is_refused_in_one_line_naming_it(poisoned, name):
    with pytest.raises(ModelLoadError) as info:
        validate.check_gguf(poisoned[name])
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{name}.gguf: ") and POISONS[name][1] in text, text


def test_the_scale_table_agrees_with_gguf():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, (block_bytes, where) in validate.SCALES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] == block_bytes, name
        assert isinstance(where, str) or all(0 <= a <= block_bytes - 2 for a in where), name


def test_the_load_refuses_before_building_anything(poisoned):
    from runtime import load_model

    for name in ("heads0", "down", "nan_one"):
        with pytest.raises(ModelLoadError, match=POISONS[name][1].replace("(", r"\(").replace(")", r"\)")):
            load_model(poisoned[name], device="cpu")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["down", "relabel", "nan_one"])
def test_chat_exits_2_with_one_line_and_no_library_warning(poisoned, name):
    r = _run("chat", "--model", str(poisoned[name]), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("attnchat: error: ") and POISONS[name][1] in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["layers", "vocab", "inf_all"])
def test_memory_refuses_what_a_load_refuses(poisoned, name, attnchat_cli):
    status, out, err = attnchat_cli("memory", "--model", str(poisoned[name]), "--context", "64")
    assert status == 2 and out == "", err
    assert err.count("\n") == 1 and POISONS[name][1] in err, err


def test_memory_refuses_also_after_a_load_cached_the_config(tiny, tmp_path, attnchat_cli):
    """A file whose config was cached (a load got that far) and whose tensors then changed."""
    status, _, err = attnchat_cli("memory", "--model", str(tiny), "--context", "64")
    assert status == 0, err
    rewrite(tiny, tmp_path / "copy.gguf")
    assert attnchat_cli("memory", "--model", str(tmp_path / "copy.gguf"), "--context", "64")[0] == 0
    rewrite(tiny, tmp_path / "copy.gguf", shapes={"blk.0.ffn_down.weight": (256, 256)})
    status, _, err = attnchat_cli("memory", "--model", str(tmp_path / "copy.gguf"), "--context", "64")
    assert status == 2 and "'blk.0.ffn_down.weight' has shape 256 x 256" in err, err


def test_serve_refuses_to_start(poisoned):
    r = _run("serve", "--model", str(poisoned["vocab"]), "--port", "0", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and POISONS["vocab"][1] in r.stderr, r.stderr


def test_the_hubs_header_check_runs_the_same_shape_rule():
    from models.hub.gguf_meta import GGUFMetaError, read_shape
    from tests.hub_stand_in import gguf_bytes

    for kw, words in [({"heads": 0}, "attention.head_count = 0"), ({"layers": 1_000_000}, "block_count = 1,000,000"),
                      ({"embd": 0}, "embedding_length = 0"), ({"heads": 4, "kv_heads": 3}, "a multiple")]:
        data = gguf_bytes(**kw)
        with pytest.raises(GGUFMetaError, match=words):
            read_shape(lambda offset, length: data[offset:offset + length])
    data = gguf_bytes()
    assert read_shape(lambda offset, length: data[offset:offset + length]).n_layers == 2


def test_a_library_warning_goes_to_the_log_not_the_terminal():
    code = ("import sys, warnings\nfrom attnchat.cli import entry\n"
            "entry.memory_cmd.run = lambda args: (warnings.warn('overflow encountered in multiply', RuntimeWarning), 0)[1]\n"
            "sys.exit(entry.main(['memory', '--layers', '1', '--kv-heads', '1', '--head-dim', '1', '--context', '1']))\n")
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "overflow" not in r.stderr and "Warning" not in r.stderr, r.stderr
