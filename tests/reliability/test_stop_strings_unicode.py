"""The stop-string matcher with random Unicode (astral characters, combining marks, ZWJ, RTL,
control characters) and random split points. tests/runtime/generate/test_streaming.py checks it on a
small ASCII alphabet where stops are frequent; here the stops are cut out of the text itself,
so they are hit as often, whatever the characters."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.generate.streaming import StopStringMatcher

UNICODE = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text(
    alphabet=st.sampled_from(list("a\x00\n\u200d\u200b\u0301👩🇫🇷東שא\ufeff")), max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=UNICODE, data=st.data())
def test_random_unicode_is_cut_exactly_at_the_first_stop(text, data):
    def cut_from_text():
        if len(text) < 1:
            return st.text(min_size=1, max_size=4)
        return st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4)).map(lambda p: text[p[0]:p[0] + p[1]])

    stops = data.draw(st.lists(cut_from_text() | st.text(min_size=1, max_size=4), min_size=1, max_size=3))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    bounds = sorted({0, len(text), *cuts})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stops)
    shown, stopped = [], False
    for piece in pieces:
        out, stopped = matcher.push(piece)
        shown.append(out)
    if not stopped:
        shown.append(matcher.flush())
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    assert stopped == bool(hits)
    assert "".join(shown) == (text[: min(hits)[1]] if hits else text)
