"""Downloads in a window's words: a fetch's failure without the command line's phrases or
Python's exception names, and its progress as bytes, percent, speed and time left.

:mod:`models` writes its messages for the terminal ("the same command resumes",
"`attnchat models files hf.co/…` lists its GGUF files", "(ReadTimeout)"); a window says what
to click instead. Plain strings: must not import torch or Qt.
"""
from __future__ import annotations

import re
import time

from desktop.sizes import part_text, rate_text

__all__ = ["DownloadRate", "for_window"]

#: httpx's exception names, as a person would say what happened.
_NAMES = {
    "ReadTimeout": "the Hub stopped answering", "ConnectTimeout": "the Hub did not answer",
    "WriteTimeout": "the upload stalled", "PoolTimeout": "too many connections were waiting",
    "TimeoutException": "the Hub did not answer in time", "ConnectError": "no connection could be made",
    "ProxyError": "the proxy refused the connection", "RemoteProtocolError": "the Hub cut the connection",
    "ReadError": "the connection broke while reading", "NetworkError": "the network failed",
    "JSONDecodeError": "its answer was not the Hub's JSON", "KeyError": "a field was missing from its answer",
    "ValueError": "its answer could not be read", "TypeError": "its answer could not be read",
}
#: Command-line advice, and what to do in the window instead.
_PHRASES = (
    (re.compile(r"the same command resumes"), "Resume (or Retry) continues from there"),
    (re.compile(r"`attnchat models files hf\.co/[^`]*` lists (its|them)( GGUF files)?"),
     r"the Hugging Face Hub tab of File > Models… lists \1\2"),
    (re.compile(r"\(`attnchat models files[^`]*` lists them with sizes\)"), "(the Hub tab lists them with sizes)"),
    (re.compile(r"`attnchat models search TEXT`"), "a search in the Hugging Face Hub tab"),
    (re.compile(r"\(`attnchat models list`, `attnchat models import PATH`\)"),
     "(File > Models…, or File > Open model… for a file you have)"),
    (re.compile(r"use `attnchat models import PATH` with a file you already have"),
     "open a model file you already have with File > Open model…"),
    (re.compile(r"`attnchat models import` the result"), "open the result with File > Open model…"),
    (re.compile(r"log in with `hf auth login`"), "log in with `hf auth login` in a terminal"),
    (re.compile(r"log in again with `hf auth login`"), "log in again with `hf auth login` in a terminal"),
)


def for_window(message: str) -> str:
    """``message`` (a :class:`models.FetchError`'s) with command-line advice turned into what
    to do in the window, and an exception's name in parentheses said in words."""
    out = message
    for pattern, words in _PHRASES:
        out = pattern.sub(words, out)
    return re.sub(r"\((\w+)\)", lambda m: f"({_NAMES[m.group(1)]})" if m.group(1) in _NAMES else m.group(0), out)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class DownloadRate:
    """Bytes per second over the last ~10 s of a download, and what it says.

    ``clock``: seconds (default :func:`time.monotonic`; tests pass their own).
    """

    WINDOW_S = 10.0

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._points: list[tuple[float, int]] = []
        self.started = clock()

    def add(self, done: int) -> None:
        now = self._clock()
        if self._points and done < self._points[-1][1]:
            self._points.clear()   # started again (a retry)
        self._points.append((now, int(done)))
        while len(self._points) > 2 and now - self._points[0][0] > self.WINDOW_S:
            self._points.pop(0)

    @property
    def speed(self) -> float | None:
        """Bytes per second lately; None until there is a second's worth of points."""
        if len(self._points) < 2:
            return None
        (t0, b0), (t1, b1) = self._points[0], self._points[-1]
        return (b1 - b0) / (t1 - t0) if t1 - t0 >= 1.0 else None

    def text(self, done: int, total: int) -> str:
        """``"41.8 of 93.8 MiB · 45 % · 3.1 MiB/s · about 17 s left"`` (speed and time once known)."""
        parts = [part_text(done, total), f"{100 * done / total:.0f} %" if total else ""]
        speed = self.speed
        if speed is not None and speed > 0:
            parts.append(rate_text(speed))
            if total > done:
                parts.append(f"about {_duration((total - done) / speed)} left")
        elif speed == 0:
            parts.append("stalled")
        return " · ".join(p for p in parts if p)

    def elapsed(self) -> str:
        """How long since it started, e.g. ``"1 min 05 s"``."""
        return _duration(self._clock() - self.started)
