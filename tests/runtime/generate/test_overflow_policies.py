"""The overflow policies as objects: one per name, each deciding its own steps."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.generate.context import OVERFLOW_POLICIES
from runtime.generate.overflow import EndReply, Rolling, TruncateMiddle, overflow_policy


def test_one_object_per_name_in_the_settings_order():
    policies = [overflow_policy(name) for name in OVERFLOW_POLICIES]
    assert [p.name for p in policies] == ["stop", "truncate-middle", "rolling"]
    assert isinstance(policies[1], TruncateMiddle) and isinstance(policies[2], Rolling)
    assert overflow_policy("rolling") is policies[2]
    with pytest.raises(ValueError, match="unknown overflow policy 'wrap'; use one of stop, truncate-middle, rolling"):
        overflow_policy("wrap")


def test_only_stop_refuses_a_prompt_that_fills_the_context():
    session = SimpleNamespace(context_limit=8, messages=[])
    with pytest.raises(EndReply) as e:
        overflow_policy("stop").begin(session, list(range(8)), None)
    assert e.value.reason == "context"
    overflow_policy("stop").begin(session, list(range(7)), None)
    overflow_policy("truncate-middle").begin(session, list(range(8)), None)
    for name in ("stop", "truncate-middle"):
        assert overflow_policy(name).chunk(session, [1, 2, 3]) == [1, 2, 3]
        assert overflow_policy(name).unseen(SimpleNamespace(messages=[], _first_kept=0)) == 0
    with pytest.raises(EndReply, match="context"):
        overflow_policy("stop").full(session, [5], None)
