"""Tests for runtime.generate.streaming: UTF-8-safe incremental detokenizing and stop strings."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.generate.streaming import IncrementalDetokenizer, StopStringMatcher

FFFD = "\ufffd"
SLOW_FIXTURE = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

TEXTS = {
    "emoji": "ok 😀🎉 done",
    "zwj_family": "family 👩‍👩‍👧 and 👨‍👩‍👧‍👦!",
    "flags": "🇫🇷🇩🇪 flags 🇯🇵",
    "skin_tone": "👍🏽 wave 👋🏿",
    "cjk": "日本語のテキスト、中文文本，한국어 텍스트。",
    "accented_latin": "Crème brûlée, façade, naïve, Ångström, Łódź, ĳ",
    "arabic": "مرحبا بالعالم، كيف حالك؟",
    "hebrew": "שלום עולם, מה שלומך?",
    "combining_marks": "e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311\u0313 \u0915\u093f",
    "devanagari_thai": "नमस्ते दुनिया สวัสดีชาวโลก",
    "code_and_newlines": "def f(x):\n    return x ** 2  # π ≈ 3.14159\n\n\tdone",
    "mixed": "Hi! 你好 🇫🇷 café שלום 👩‍👩‍👧 e\u0301\n",
}


def stream(tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def assert_streams_exactly(tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[str]:
    pieces = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == full
    if FFFD not in full:
        assert not any(FFFD in piece for piece in pieces), pieces
    return pieces


# --- the real default tokenizer (byte-level BPE) -------------------------------------------


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_real_tokenizer_streams_without_split_characters(default_tokenizer, name):
    ids = default_tokenizer.encode(TEXTS[name], add_special_tokens=False)
    pieces = assert_streams_exactly(default_tokenizer, ids)
    assert "".join(pieces) == TEXTS[name]


def test_the_cases_really_split_characters_across_tokens(default_tokenizer):
    """Guard for the test above: one token at a time, these texts do decode to U+FFFD."""
    ids = default_tokenizer.encode(TEXTS["zwj_family"] + TEXTS["flags"], add_special_tokens=False)
    assert any(FFFD in default_tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(default_tokenizer, skip):
    ids = default_tokenizer.encode("<|im_start|>assistant\nSalut 🇫🇷<|im_end|>", add_special_tokens=False)
    text = "".join(assert_streams_exactly(default_tokenizer, ids, skip_special_tokens=skip))
    assert ("<|im_end|>" in text) is not skip


@SLOW_FIXTURE
@given(text=st.text(max_size=80))
def test_random_text_streams_exactly(default_tokenizer, text):
    assert_streams_exactly(default_tokenizer, default_tokenizer.encode(text, add_special_tokens=False))


@SLOW_FIXTURE
@given(data=st.data(), skip=st.booleans())
def test_random_token_ids_stream_exactly(default_tokenizer, data, skip):
    """Any id sequence, invalid UTF-8 and special tokens included: the join still equals decode."""
    ids = data.draw(st.lists(st.integers(0, len(default_tokenizer) - 1), max_size=40))
    pieces = stream(default_tokenizer, ids, skip_special_tokens=skip)
    assert "".join(pieces) == default_tokenizer.decode(ids, skip_special_tokens=skip)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode was given."""

    def __init__(self, inner) -> None:
        self.inner, self.sizes = inner, []

    def decode(self, ids, skip_special_tokens=False):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_only_a_small_window(default_tokenizer):
    ids = default_tokenizer.encode(("The café 日本 👩‍👩‍👧 🇫🇷 fox. " * 60), add_special_tokens=False)
    counting = CountingTokenizer(default_tokenizer)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.push(i)
    assert len(ids) > 1000
    assert max(counting.sizes) <= 16  # the window, not the reply: O(1) per token
    assert len(counting.sizes) <= 2 * len(ids)
    assert detok.text + detok.flush() == default_tokenizer.decode(ids)


# --- tokenizers whose decode of a window differs from a slice of the full decode -----------


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Llama-style SentencePiece tokenizer: '▁' for spaces, byte fallback, and a
    decoder that strips the leading space of every decode (as Llama 2 and Mistral do)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁abcdefghijklmnopqrstuvwxyzHW.,":
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "w"), ("▁w", "o"), ("▁", "H"), ("e", "l"), ("el", "l"), ("ell", "o")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("text", ["Hello world, hello  wo.", "  Hello   world  ", *TEXTS.values()])
def test_sentencepiece_leading_spaces_and_byte_fallback(sentencepiece_tokenizer, text):
    ids = sentencepiece_tokenizer.encode(text, add_special_tokens=False)
    pieces = assert_streams_exactly(sentencepiece_tokenizer, ids)
    # Without left context the spaces would be lost: each token alone decodes stripped.
    if "  " in text:
        assert "".join(sentencepiece_tokenizer.decode([i]) for i in ids) != "".join(pieces)


@SLOW_FIXTURE
@given(text=st.text(alphabet=st.sampled_from(list("Helo wrd.,é日👩\u200d🇫🇷 ")), max_size=60))
def test_sentencepiece_random_text_streams_exactly(sentencepiece_tokenizer, text):
    assert_streams_exactly(sentencepiece_tokenizer, sentencepiece_tokenizer.encode(text, add_special_tokens=False))


class PieceTokenizer:
    """Each id is an index into a list of strings; decode joins them, then applies a rule."""

    def __init__(self, vocab: Sequence[str], rule) -> None:
        self.vocab, self.rule = list(vocab), rule

    def decode(self, ids, skip_special_tokens=False):
        return self.rule("".join(self.vocab[i] for i in ids))


def drop_space_before_word_at_start(text: str) -> str:
    return text[1:] if len(text) > 1 and text[0] == " " and text[1].isalpha() else text


@pytest.mark.parametrize(
    "rule",
    [str.lstrip, drop_space_before_word_at_start],
    ids=["strips_all_leading_whitespace", "window_decode_not_a_prefix_extension"],
)
def test_decoders_that_treat_the_start_of_a_decode_specially(rule, caplog):
    vocab = ["a", " ", "b", "  ", ".", "\n"]
    tokenizer = PieceTokenizer(vocab, rule)
    ids = [0, 1, 1, 2, 4, 3, 1, 0, 5, 1, 2] * 6 + [1] * 12 + [2, 0, 1, 4, 3, 2]
    with caplog.at_level(logging.WARNING, logger="runtime.generate.streaming"):
        assert_streams_exactly(tokenizer, ids)
    assert not caplog.records


def test_a_decoder_that_rewrites_shown_text_is_reported(caplog):
    """Shown text cannot be taken back: the mismatch is logged, never silent."""
    tokenizer = PieceTokenizer(["a", "!"], lambda text: text.upper() if text.endswith("!") else text)
    detok = IncrementalDetokenizer(tokenizer)
    with caplog.at_level(logging.WARNING, logger="runtime.generate.streaming"):
        assert detok.push(0) == "a"
        detok.push(1)
        detok.flush()
    assert any("rewrote" in record.getMessage() for record in caplog.records)


# --- stop strings -------------------------------------------------------------------------


def run_matcher(stops: Sequence[str], pieces: Sequence[str]) -> tuple[list[str], bool, StopStringMatcher]:
    matcher = StopStringMatcher(stops)
    shown, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        shown.append(text)
    if not stopped:
        shown.append(matcher.flush())
    return shown, stopped, matcher


def test_stop_string_split_across_pieces_is_never_shown():
    shown, stopped, matcher = run_matcher(["\nUser:"], ["Hello", "\nUs", "er:", " more"])
    assert shown == ["Hello", "", "", ""] and stopped and matcher.matched == "\nUser:"


def test_partial_prefix_that_does_not_complete_is_released():
    shown, stopped, _ = run_matcher(["\nUser:"], ["Hi", "\nUs", "ually"])
    assert shown == ["Hi", "", "\nUsually", ""] and not stopped
    shown, stopped, _ = run_matcher(["\nUser:"], ["Hi", "\nUs"])
    assert shown == ["Hi", "", "\nUs"] and not stopped  # released by flush()


def test_first_of_several_stop_strings_to_complete_wins():
    shown, stopped, matcher = run_matcher(["</s>", "\nUser:"], ["a\nUs", "er: b</s>"])
    assert "".join(shown) == "a" and stopped and matcher.matched == "\nUser:"
    shown, _, matcher = run_matcher(["</s>", "\nUser:"], ["a</", "s>\nUser:"])
    assert "".join(shown) == "a" and matcher.matched == "</s>"


def test_the_stop_that_completes_first_wins_whatever_the_split():
    for pieces in (["::", ":s:"], [":::s:"], [":", ":", ":", "s", ":"]):
        shown, _, matcher = run_matcher(["s", ":s:"], pieces)
        assert "".join(shown) == ":::" and matcher.matched == "s"


def test_stop_string_at_the_very_start():
    assert run_matcher(["\nUser:"], ["\nUser: hi"])[0] == [""]
    assert run_matcher(["\nUser:"], ["\n", "User:", "x"])[0] == ["", "", ""]


def test_text_after_the_stop_is_dropped():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("keep STOP drop") == ("keep ", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_or_empty_stop_strings_pass_text_through():
    for stops in ([], [""]):
        matcher = StopStringMatcher(stops)
        assert matcher.push("any\nUser: text") == ("any\nUser: text", False)
        assert matcher.flush() == ""


def test_detokenizer_into_stop_matcher(default_tokenizer):
    ids = default_tokenizer.encode("Voilà 🇫🇷!\nUser: next question", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(default_tokenizer), StopStringMatcher(["\nUser:"])
    shown = []
    for i in ids:
        text, stopped = matcher.push(detok.push(i))
        shown.append(text)
        if stopped:
            break
    assert "".join(shown) == "Voilà 🇫🇷!"


ALPHABET = "ab\nUser:</s>"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_output_is_text_cut_at_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    shown, stopped, _ = run_matcher(stops, pieces)
    # the stop that completes first (ties: starts first), as if the text came char by char
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    assert stopped == bool(hits)
    assert "".join(shown) == (text[: min(hits)[1]] if hits else text)
    if len(stops) == 1:
        assert "".join(shown) == text.split(stops[0])[0]
