"""runtime.insight.context_cost: the scores count and the attention timing on a tiny seeded model."""
from __future__ import annotations

import pytest

from runtime import load_model
from runtime.insight.context_cost import attention_step_seconds, scores_per_head


def test_scores_per_head_match_the_worked_numbers():
    assert scores_per_head(1_000, prefill=True) == 1_000_000          # about a million
    assert scores_per_head(100_000, prefill=True) == 10_000_000_000   # ten billion
    assert scores_per_head(100_000, prefill=False) == 100_000


def test_attention_step_time_on_a_tiny_model(tmp_path):
    from tests.runtime.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32")
    t = attention_step_seconds(model, 100, repeats=3)
    assert t.seconds > 0 and t.per_layer_seconds == pytest.approx(t.seconds / 2)
    assert (t.n_layers, t.n_heads, t.n_kv_heads, t.head_dim, t.context) == (2, 4, 2, 16, 100)
    assert t.device == "cpu" and t.dtype == "float32"
    with pytest.raises(ValueError, match="context"):
        attention_step_seconds(model, 129)
