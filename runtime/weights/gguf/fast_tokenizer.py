"""A GGUF's converted tokenizer read through ``tokenizers`` directly, without transformers.

Must not import Qt, nor transformers at import time. Why: importing transformers costs 1.1 s
of a 3.3 s load of the default model (quiet 2-core AMD EPYC Zen 3), for a tokenizer whose
work is all in ``tokenizers``' Rust code: transformers' fast tokenizer encodes with the Rust
tokenizer's ``encode``, decodes with its ``decode`` and reads the special tokens from its
tokenizer_config.json. :class:`FastTokenizer` does the same for what attnchat asks of a
tokenizer (ids, text, special tokens, the chat template); anything else (constrained
decoding's tokenizer, ``save_pretrained``, ...) builds transformers' own tokenizer from the
same files on first use and hands the call to it (:meth:`FastTokenizer.as_transformers`).

Only files transformers would read to the same tokenizer take this path (:func:`read`): no
options that make transformers change the Rust tokenizer (added special tokens, BOS/EOS
switches, a post-processor, clean-up of spaces), special tokens given as plain strings.
A test checks both on the real default and Gemma 3 files: the same ids, text and special tokens.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable

__all__ = ["FastTokenizer", "compact_merges", "read", "transformers_tokenizer"]

#: Beside a tokenizer.json whose BPE merges :func:`compact_merges` has written as strings
#: (or found nothing to change in): it is not read again to find out.
COMPACT_MARK = "attnchat-merges-compact"

#: transformers' named special tokens (``SPECIAL_TOKENS_ATTRIBUTES``), in its order.
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: tokenizer_config.json keys that change nothing transformers' fast tokenizer does with the
#: Rust tokenizer (its length limits, where padding goes, the class's name, the chat template).
_PLAIN_KEYS = {*NAMED, "extra_special_tokens", "additional_special_tokens", "chat_template", "model_max_length",
               "padding_side", "truncation_side", "model_input_names", "clean_up_tokenization_spaces",
               "add_prefix_space", "name_or_path"}


def read(tokenizer_file: Path, kwargs: dict[str, Any]) -> "FastTokenizer | None":
    """A :class:`FastTokenizer` of ``tokenizer_file`` with tokenizer_config.json's ``kwargs``
    (provenance keys removed, ``chat_template`` and ``name_or_path`` added), or None where
    transformers would make another tokenizer of them (then use transformers').

    Raises:
        Exception: whatever ``tokenizers`` raises for an unreadable file.
    """
    if set(kwargs) - _PLAIN_KEYS or kwargs.get("clean_up_tokenization_spaces") or kwargs.get("add_prefix_space"):
        return None
    extra = kwargs.get("extra_special_tokens", kwargs.get("additional_special_tokens")) or []
    named = {k: kwargs[k] for k in NAMED if kwargs.get(k) is not None}
    if not isinstance(extra, (list, tuple)) or not all(isinstance(t, str) for t in [*named.values(), *extra]):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_file))
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    if not set(named.values()) | set(extra) <= added:   # transformers would add them to the vocabulary
        return None
    if backend.truncation is not None or backend.padding is not None:   # transformers resets both
        return None
    return FastTokenizer(backend, tokenizer_file, kwargs, named, list(extra))


def compact_merges(tokenizer_file: Path, backend=None) -> bool:
    """Rewrite a BPE tokenizer.json's merges from pairs (``["a", "b"]``, what ``tokenizers``
    saves) to the strings ``"a b"`` it also reads, without indentation, and mark the folder
    (:data:`COMPACT_MARK`); True when the file was rewritten. Why: ``tokenizers`` reads it
    faster. Gemma 3's 514,906 merges: 0.55 s against 0.85 s for the whole tokenizer (Intel
    Xeon, 2 cores). It builds the same tokenizer either way: a string merge is split at its
    space, so a file with a space inside a piece keeps its pairs (left as it is).

    ``backend``: the ``tokenizers.Tokenizer`` the file holds, when already built (its JSON is
    read instead of the file). Gemma 3's takes 1.2-1.3 s either way (Python's JSON, once per
    kept folder: at its conversion, or at the first load of a folder kept before). The file is replaced
    atomically; one that cannot be read or written, or in a folder this process cannot write,
    is left as it is (the mark then not written either), since the pairs form reads as well,
    only slower.
    """
    import itertools
    import json
    import os

    mark = tokenizer_file.with_name(COMPACT_MARK)
    if not os.access(tokenizer_file.parent, os.W_OK):   # (a folder we cannot write: not read for nothing at every load)
        return False
    try:
        text = backend.to_str() if backend is not None else tokenizer_file.read_text(encoding="utf-8")
        data = json.loads(text)
        model = data.get("model") or {}
        merges = model.get("merges")
        changed = False
        if model.get("type") == "BPE" and isinstance(merges, list) and merges and all(type(m) is list for m in merges):
            pieces = list(itertools.chain.from_iterable(merges))   # (C loops: 515k merges in milliseconds)
            changed = len(pieces) == 2 * len(merges) and all(type(p) is str for p in pieces) and " " not in "".join(pieces)
        if changed:
            model["merges"] = list(map(" ".join, merges))
            tmp = tokenizer_file.with_name(tokenizer_file.name + f".tmp{os.getpid()}")
            try:
                compact = {"separators": (",", ":")}
                text = json.dumps(data, ensure_ascii=False, **compact)   # UTF-8 reads 5 % faster than escapes
                try:
                    raw = text.encode("utf-8")
                except UnicodeEncodeError:   # a lone surrogate in a token: kept escaped, as it came
                    raw = json.dumps(data, **compact).encode("ascii")
                tmp.write_bytes(raw)
                os.replace(tmp, tokenizer_file)
            finally:
                tmp.unlink(missing_ok=True)
        mark.write_text("merges as strings where a piece has no space\n", encoding="utf-8")
        return changed
    except (OSError, ValueError, UnicodeError):
        return False


class FastTokenizer:
    """transformers' fast tokenizer's answers from the Rust tokenizer alone.

    Attributes:
        backend_tokenizer: the ``tokenizers.Tokenizer``.
        chat_template: the Jinja chat template (str) or None.
        name_or_path: the cache folder it was read from (str).
    """

    def __init__(self, backend, tokenizer_file: Path, kwargs: dict[str, Any], named: dict[str, str],
                 extra: list[str]):
        self.backend_tokenizer = backend
        self.chat_template = kwargs.get("chat_template")
        self.name_or_path = str(kwargs.get("name_or_path", ""))
        self._file, self._kwargs, self._named, self._extra = tokenizer_file, kwargs, named, extra
        self._transformers = None
        self._lock = threading.Lock()

    # ---- special tokens (transformers' PreTrainedTokenizerBase semantics) ---------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set: ``{"bos_token": "<bos>", ...}``."""
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, each once, as text."""
        return list(dict.fromkeys([*self._named.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of :attr:`all_special_tokens`, in order."""
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """id -> ``tokenizers.AddedToken`` of every added token, by id."""
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def __getattr__(self, name: str):
        # bos_token / bos_token_id and the other named tokens; then anything else: transformers'
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)
        base = name.removesuffix("_id")
        if base in NAMED:
            token = self._named.get(base)
            if token is None:
                return None
            return self.convert_tokens_to_ids(token) if base != name else token
        return getattr(self.as_transformers(), name)

    # ---- ids and text ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (added tokens not counted), as transformers gives it."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        """A token's id (the unknown token's, or None, for a token not in the vocabulary); a list for a list."""
        if isinstance(tokens, str):
            i = self.backend_tokenizer.token_to_id(tokens)
            if i is None and self._named.get("unk_token") is not None:
                return self.backend_tokenizer.token_to_id(self._named["unk_token"])
            return i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """A token's text as the vocabulary spells it (``int`` -> str, a list -> a list)."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` -> token ids (``add_special_tokens``: the post-processor's, e.g. a BOS)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Token ids (a list, a tensor or one int) -> text."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids   # a tensor or array, 0-d included
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """``text`` -> the tokens' texts."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def __call__(self, *args, **kwargs):
        return self.as_transformers()(*args, **kwargs)

    # ---- the rest: transformers' own tokenizer ----------------------------------------------
    def as_transformers(self):
        """transformers' ``PreTrainedTokenizerFast`` of the same files (built, and transformers
        imported, on the first call: about a second, more for a large vocabulary)."""
        with self._lock:
            if self._transformers is None:
                from transformers import PreTrainedTokenizerFast

                self._transformers = PreTrainedTokenizerFast(tokenizer_file=str(self._file), **self._kwargs)
            return self._transformers


def transformers_tokenizer(tokenizer):
    """``tokenizer`` as transformers' own (what a library that checks the class needs)."""
    return tokenizer.as_transformers() if isinstance(tokenizer, FastTokenizer) else tokenizer
