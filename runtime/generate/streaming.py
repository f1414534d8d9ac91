"""Streaming the text of a reply: token ids -> stable text pieces -> text safe to show.

IncrementalDetokenizer turns token ids into text one id at a time without ever showing
half a character; StopStringMatcher holds back text that might be the start of a stop
string. Both work on plain str and ints; the tokenizer is any object with
`decode(ids, skip_special_tokens=...)` (a transformers tokenizer).

This module must not import Qt (PySide6, pyqtgraph); it does not need torch either.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Slide the decode window once it spans this many tokens. It then keeps as left context
# the tokens since the previous clean boundary (>= 1 token), as TGI and vLLM do with
# prefix_offset/read_offset; 8 keeps each decode tiny while sliding only now and then.
_SLIDE_AT = 8


class IncrementalDetokenizer:
    """Decode a stream of token ids into text pieces that never split a character.

    Invariant: "".join(every push() result, then flush()) ==
    tokenizer.decode(all_pushed_ids, skip_special_tokens=skip_special_tokens), and no
    piece contains a U+FFFD that only stands for a character whose bytes are split across
    tokens (the 4 byte tokens of one emoji): while the decoded window ends with U+FFFD,
    all its new text is held back.

    Method: the prefix_offset/read_offset scheme of Hugging Face TGI and vLLM
    (vllm/transformers_utils/detokenizer_utils.py). Each push decodes only a window of
    recent tokens that starts a little before the text not yet returned, and returns the
    part of that window's text beyond what it had already returned. The left context
    makes decoders that treat the start of a decode specially (SentencePiece strips the
    leading space of the first token) agree with the full decode. Holding the whole new
    tail, not only its last characters, matters for SentencePiece byte fallback, whose
    decode turns a whole run of byte tokens into U+FFFD while its last character is
    incomplete. Cost per token: one decode of at most ~_SLIDE_AT tokens (plus the bytes
    of a pending character), and one more each time the window slides.

    Safety nets, for tokenizers whose decode is less local than that:
    - if a window's decode is not a prefix-extension of what it already returned, the
      window is re-anchored on the full decode (O(length), only when that happens);
    - the window slides only to a start whose decode is non-empty and is a suffix of the
      text already returned (a start on a lone space would lose it under a decoder that
      strips leading whitespace);
    - flush() decodes the full sequence once and returns exactly what is missing, so the
      invariant holds whenever the returned text is a prefix of the full decode. If it
      is not (a tokenizer that rewrites earlier text when later tokens arrive), shown text
      cannot be taken back: flush logs a warning and returns the rest beyond it.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._pieces: list[str] = []  # everything returned so far
        self._start = 0  # first token of the decode window (prefix_offset)
        self._last_clean = 0  # token count after the latest push that held nothing (read_offset)
        self._window_text = ""  # decode(ids[_start:_last_clean]): the window's text already returned

    @property
    def text(self) -> str:
        """All text returned by push() and flush() so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """A copy of every id pushed so far."""
        return list(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _tail(self, n: int) -> str:
        """At least the last n characters returned (fewer only if less was returned)."""
        parts: list[str] = []
        size = 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            size += len(piece)
            if size >= n:
                break
        return "".join(reversed(parts))

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that became stable (often "", never a split character)."""
        self._ids.append(int(token_id))
        window = self._decode(self._ids[self._start :])
        if window.endswith(_REPLACEMENT):
            return ""  # a character whose remaining bytes have not arrived yet
        if not window.startswith(self._window_text):
            # The window's decode changed text it had already produced: fall back to the
            # full decode, measured against everything returned.
            done = self.text
            self._start, self._window_text = 0, done
            window = self._decode(self._ids)
            if not window.startswith(done):
                log.warning("decode of the full sequence rewrote text already streamed")
        piece = self._emit(window[len(self._window_text) :])
        self._window_text = window
        self._maybe_slide()
        self._last_clean = len(self._ids)
        return piece

    def _maybe_slide(self) -> None:
        """Move the window start to the previous clean boundary once the window got long."""
        start = self._last_clean
        if len(self._ids) - self._start < _SLIDE_AT or start <= self._start:
            return
        context = self._decode(self._ids[start:])
        if context and self._tail(len(context)).endswith(context):
            self._start, self._window_text = start, context

    def flush(self) -> str:
        """Return whatever is still held back (one full decode; call once, when the reply ends)."""
        full = self._decode(self._ids)
        done = self.text
        if not full.startswith(done):
            log.warning("decode of the full sequence rewrote text already streamed")
        self._start, self._last_clean, self._window_text = 0, len(self._ids), full
        return self._emit(full[len(done) :])


class StopStringMatcher:
    """Cut a stream of text at the first occurrence of any stop string.

    push(text) returns (text safe to show now, stopped). The longest tail of the text
    seen so far that is a prefix of some stop string is held back, so a stop string that
    arrives across several pieces ("\\nUs" + "er:") is never shown. On a full match, push
    returns the text before the stop string and stopped=True, and ignores all later input.
    flush() returns the held-back text when the reply ends for another reason.

    Invariant: the concatenation of everything returned equals the whole text cut before
    the occurrence of a stop string that completes first (ties: the one that starts
    first), whatever the split into pieces; the whole text when none occurs. With one
    stop string that is text.split(stop)[0].
    Empty stop strings are ignored; with none left, push returns its input unchanged.
    Same method as the stop-sequence handling in vLLM and llama.cpp's server
    (find the full stop, else hold back the longest partial match at the end).
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, if any

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to show now, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return text, False
        buffer = self._held + text
        # The occurrence that completes first wins (ties: the one that starts first), as it
        # would if the text arrived one character at a time; this makes the result
        # independent of how the text is split into pieces.
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return buffer[: best[1]], True
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of a stop string."""
        for n in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self.stop_strings):
                return n
        return 0

    def flush(self) -> str:
        """Return the held-back text (nothing after a stop); the matcher then holds nothing."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
