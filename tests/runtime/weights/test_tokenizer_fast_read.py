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


@pytest.mark.parametrize("entry_name", ["DEFAULT_MODEL", "GEMMA3_270M"])
def test_the_fast_read_needs_no_transformers_and_answers_as_it_does(entry_name):
    """The cached tokenizer is read through ``tokenizers`` alone (no transformers import on a
    load) and answers what attnchat asks of a tokenizer as transformers' own does."""
    from transformers import AutoTokenizer

    from models import catalog
    from runtime.weights.gguf.converted import _read_cached_fast
    from runtime.weights.gguf.fast_tokenizer import FastTokenizer, transformers_tokenizer

    folder = _cached_folder(getattr(catalog, entry_name))
    _, fast = _read_cached_fast(folder)
    assert isinstance(fast, FastTokenizer)
    own = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        for special in (False, True):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == own.encode(text, add_special_tokens=special), (text, special)
            assert fast.tokenize(text) == own.tokenize(text), text
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == own.decode(ids, skip_special_tokens=skip), text
        assert fast.convert_ids_to_tokens(ids) == own.convert_ids_to_tokens(ids)
        assert fast.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            own.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert fast.decode(ids[0]) == own.decode(ids[0])
    import torch

    assert fast.decode(torch.tensor(ids)) == own.decode(ids) and fast.decode(torch.tensor(ids[0])) == own.decode(ids[0])
    for name in (*SPECIAL, "bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "special_tokens_map",
                 "all_special_tokens", "vocab_size", "extra_special_tokens"):
        assert getattr(fast, name) == getattr(own, name), name
    assert {i: str(t) for i, t in fast.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in own.added_tokens_decoder.items()}
    assert fast.convert_tokens_to_ids(["<unk>", "no-such-token-at-all"]) == own.convert_tokens_to_ids(["<unk>", "no-such-token-at-all"])
    # what it does not answer itself, transformers' own tokenizer of the same files does
    assert type(transformers_tokenizer(fast)).__name__ == "TokenizersBackend"
    assert fast.save_pretrained.__self__ is transformers_tokenizer(fast)


def test_a_load_with_its_cache_folder_kept_imports_no_transformers():
    """Importing transformers was a second of the default model's load; with the cache folder
    kept, a load of a GGUF's blocks reads everything without it."""
    import subprocess
    import sys

    from models import catalog

    _cached_folder(catalog.DEFAULT_MODEL)
    code = ("import sys; from runtime import load_model; m = load_model(None, device='cpu'); "
            "print('transformers' in sys.modules, type(m.tokenizer).__name__, m.encode('Paris')[:1] != [])")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "FastTokenizer", "True"]


def _bpe_file(tmp_path, merges):
    """A tiny BPE tokenizer.json as ``tokenizers`` saves it (merges as pairs)."""
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "b": 1, "c": 2, " ": 3, "ab": 4, "abc": 5, "a b": 6, "c ": 7}
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE(vocab=vocab, merges=merges)).save(str(path))
    return path


def test_compact_merges_writes_strings_that_read_to_the_same_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from runtime.weights.gguf.fast_tokenizer import COMPACT_MARK, compact_merges

    path = _bpe_file(tmp_path, [("a", "b"), ("ab", "c")])
    before = Tokenizer.from_file(str(path))
    assert json.loads(path.read_text())["model"]["merges"] == [["a", "b"], ["ab", "c"]]
    assert compact_merges(path) is True
    assert json.loads(path.read_text())["model"]["merges"] == ["a b", "ab c"]
    after = Tokenizer.from_file(str(path))
    assert after.to_str() == before.to_str()
    assert after.encode("abcab").ids == before.encode("abcab").ids == [5, 4]
    assert (tmp_path / COMPACT_MARK).exists()
    assert compact_merges(path) is False   # strings already: nothing to rewrite
    assert sorted(p.name for p in tmp_path.iterdir()) == [COMPACT_MARK, "tokenizer.json"]   # no temporary left


def test_compact_merges_leaves_a_file_with_a_space_inside_a_piece(tmp_path):
    """``"a b c"`` could not say which space parts the pair: such a file keeps its pairs."""
    from runtime.weights.gguf.fast_tokenizer import COMPACT_MARK, compact_merges

    path = _bpe_file(tmp_path, [("a", "b"), ("c", " ")])
    text = path.read_text()
    assert compact_merges(path) is False
    assert path.read_text() == text
    assert (tmp_path / COMPACT_MARK).exists()


def test_compact_merges_on_a_broken_file_changes_nothing(tmp_path):
    from runtime.weights.gguf.fast_tokenizer import COMPACT_MARK, compact_merges

    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "BPE", "merges": [["a", "b"]')
    assert compact_merges(path) is False
    assert path.read_text() == '{"model": {"type": "BPE", "merges": [["a", "b"]'
    assert not (tmp_path / COMPACT_MARK).exists()


@pytest.mark.parametrize("entry_name", ["DEFAULT_MODEL", "GEMMA3_270M"])
def test_the_kept_tokenizer_is_compact_and_is_the_files_own(entry_name, tmp_path):
    """The cache folder's tokenizer.json holds string merges, and reads to the tokenizer its
    pairs form does (written again as pairs here, compacted, compared whole)."""
    from tokenizers import Tokenizer

    from models import catalog
    from runtime.weights.gguf.fast_tokenizer import COMPACT_MARK, compact_merges

    folder = _cached_folder(getattr(catalog, entry_name))
    assert (folder / COMPACT_MARK).exists()
    kept = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert all(isinstance(m, str) for m in json.loads((folder / "tokenizer.json").read_text())["model"]["merges"])
    pairs = tmp_path / "tokenizer.json"
    kept.save(str(pairs))
    assert isinstance(json.loads(pairs.read_text())["model"]["merges"][0], list)
    assert compact_merges(pairs) is True
    assert Tokenizer.from_file(str(pairs)).to_str() == kept.to_str()
    for text in TEXTS:
        assert Tokenizer.from_file(str(pairs)).encode(text).ids == kept.encode(text).ids


def test_compact_merges_in_a_folder_it_cannot_write_reads_nothing(tmp_path, monkeypatch):
    """A kept folder this process may not write (a shared or read-only cache): nothing is read
    or parsed (it would be again at every load, 1.2 s of Gemma 3's), the file stays as it is."""
    import os

    from runtime.weights.gguf.fast_tokenizer import COMPACT_MARK, compact_merges

    path = _bpe_file(tmp_path, [("a", "b"), ("ab", "c")])
    text = path.read_text()
    monkeypatch.setattr(os, "access", lambda p, mode: not (mode & os.W_OK and str(p) == str(tmp_path)))
    import json

    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed a file it cannot rewrite"))
    assert compact_merges(path) is False
    assert path.read_text() == text and not (tmp_path / COMPACT_MARK).exists()
