"""The converted-weights cache: a second load reads it and gives the same logits; a broken one
is rebuilt. Only a GGUF our quantized layers do not take (here an all-float16 file) is
converted: a quantized GGUF runs from its own blocks and leaves no copy (test_gguf_blocks)."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from tests.runtime.memory_maps import mapped_files
from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

pytestmark = pytest.mark.slow


def test_second_load_uses_converted_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_gguf(tmp_path, matrix_type="F16", embed_type="F16", tokenizer=tiny_tokenizer_metadata())
    first = load_model(path, device="cpu", dtype="float32")
    ids = first.encode("The capital of France is")
    converted = list(tmp_path.rglob("decoder-v*-float32.safetensors"))
    assert len(converted) == 1
    n_params = sum(p.numel() for p in first.decoder.parameters())
    assert n_params > 1_000_000 and converted[0].stat().st_size >= n_params * 4  # float32, every parameter
    second = load_model(path, device="cpu", dtype="float32")
    # Both loads hold the weights as pages of the converted file, not as copies in memory
    # (the first load reads its own conversion back).
    assert mapped_files(first) == mapped_files(second) == {str(converted[0].resolve())}
    # The same kernels (a choice timed on a busy machine is not kept, so each load may time
    # and pick another kernel, rounding differently): weights compared.
    second.decoder.set_kernels(first.kernels)
    expected = first.logits(ids)
    assert expected.abs().max() > 0
    torch.testing.assert_close(second.logits(ids), expected, atol=0, rtol=0)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    # A damaged converted file is ignored and rebuilt, never trusted.
    converted[0].write_bytes(b"not safetensors")
    third = load_model(path, device="cpu", dtype="float32")
    third.decoder.set_kernels(first.kernels)
    torch.testing.assert_close(third.logits(ids), expected, atol=0, rtol=0)
    assert converted[0].stat().st_size >= n_params * 4


def test_second_load_reads_our_config_and_the_fast_tokenizer(default_model_file, default_model, tmp_path, monkeypatch):
    """The second load needs no transformers config class: our own config file and the
    saved fast tokenizer give the same config, tokens and chat prompt; a damaged config
    file falls back to transformers' and is written again."""
    from runtime import read_config
    from runtime.weights.gguf import converted as loader

    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(tmp_path))
    load_model(default_model_file, device="cpu")
    (config_file,) = tmp_path.rglob(loader.CONFIG_FILE)
    second = load_model(default_model_file, device="cpu")
    assert second.config == default_model.config
    assert read_config(default_model_file) == default_model.config
    text = "Héllo <|im_start|> wörld 123"
    assert second.encode(text) == default_model.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        default_model.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert second.stop_token_ids == default_model.stop_token_ids
    config_file.write_text("{not json")
    third = load_model(default_model_file, device="cpu")
    assert third.config == default_model.config
    assert loader.cached_model_config(config_file.parent) == default_model.config  # rewritten
