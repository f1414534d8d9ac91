"""A GGUF's tokenizer kept in the cache folder is read back as the fast tokenizer from its
tokenizer.json (no class-specific rebuild of the vocabulary), and gives what transformers'
own class gives: the same ids, the same decoded text, the same special tokens.

On the real Gemma 3 270M file (a 262,144-token vocabulary, the one where the rebuild costs
seconds) and on the default model.
"""
from __future__ import annotations

import json

import pytest

TEXTS = [
    "The capital of France is",
    "Hello\n\nworld  ünïcödé 😀 <start_of_turn>user\nhi<end_of_turn>\n",
    "   leading spaces and trailing   ",
    "日本語のテキスト, Ελληνικά, عربى",
    "<bos>x<eos>",
    "tab\tand\r\nnewlines\n\n\n",
    "def f(x):\n    return x ** 2  # code",
]
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template", "all_special_ids")


def _cached_folder(entry):
    import models
    from runtime.weights.gguf.converted import gguf_cache_dir
    from runtime.weights.gguf.open import config_and_tokenizer, open_gguf

    path = models.installed_path(entry) or models.fetch_model(entry)
    config_and_tokenizer(path, open_gguf(path))  # writes the cache folder on a first load
    return gguf_cache_dir(path)


@pytest.mark.parametrize("entry_name", ["DEFAULT_MODEL", "GEMMA3_270M"])
def test_the_fast_read_gives_transformers_own_tokenizer(entry_name):
    from transformers import AutoTokenizer

    from models import catalog
    from runtime.weights.gguf.converted import _read_cached_fast

    folder = _cached_folder(getattr(catalog, entry_name))
    cls = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["tokenizer_class"]
    cfg, fast = _read_cached_fast(folder)
    assert cfg is not None and fast is not None, f"{cls} is not read by the fast path"
    own = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        ids = fast(text)["input_ids"]
        assert ids == own(text)["input_ids"], text
        assert fast.decode(ids) == own.decode(ids)
        assert fast.decode(ids, skip_special_tokens=True) == own.decode(ids, skip_special_tokens=True)
    for name in SPECIAL:
        assert getattr(fast, name) == getattr(own, name), name
    assert len(fast) == len(own) and fast.get_vocab() == own.get_vocab()


@pytest.mark.parametrize("entry_name", ["DEFAULT_MODEL", "GEMMA3_270M"])
def test_stop_ids_are_every_end_of_turn_token_in_the_vocabulary(entry_name):
    from models import catalog
    from runtime.loader.load import END_OF_TURN_TOKENS, _stop_ids
    from runtime.weights.gguf.converted import _read_cached_fast

    cfg, fast = _read_cached_fast(_cached_folder(getattr(catalog, entry_name)))
    vocab = fast.get_vocab()
    want = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab} | set(cfg.eos_token_ids) | {fast.eos_token_id}
    got = _stop_ids(fast, cfg)
    assert got == want
    # the turn ends each chat template writes are among them
    ends = {"DEFAULT_MODEL": "<|im_end|>", "GEMMA3_270M": "<end_of_turn>"}[entry_name]
    assert vocab[ends] in got
