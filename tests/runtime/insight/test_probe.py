"""Attention capture and head scores (Olsson et al. 2022 probe)."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.insight.probe import (
    AttentionCapture,
    head_scores,
    repeated_random_tokens,
    scores_from_weights,
)
from runtime.model.attention import attention
from runtime.model.rope import apply_rope


def _planted(T: int, N: int, kind: str) -> torch.Tensor:
    """Causal attention rows (T, T) with one planted pattern."""
    w = torch.zeros(T, T)
    w[0, 0] = 1.0
    for q in range(1, T):
        if kind == "previous":
            w[q, q - 1] = 1.0
        elif kind == "induction" and q >= 1 + N:
            w[q, q - N + 1] = 1.0
        else:
            w[q, : q + 1] = 1.0 / (q + 1)  # uniform
    return w


def test_scores_find_planted_heads():
    N, T = 10, 21
    uniform = _planted(T, N, "uniform")
    heads = torch.stack([_planted(T, N, "previous"), _planted(T, N, "induction"), uniform])  # (H, T, T)
    weights = heads[None, None].expand(2, 3, 3, T, T)  # (L, B, H, T, T)
    induction, previous = scores_from_weights(weights, N)
    assert previous[0, 0] == pytest.approx(1.0)
    assert induction[0, 1] == pytest.approx(1.0)
    assert induction[0, 0] == pytest.approx(0.0)
    assert previous[0, 1] < 0.6  # only the first copy and BOS rows look back one
    # Uniform rows: the score is the mean of 1/(q+1) over the query positions.
    q = torch.arange(1 + N, T).float()
    assert induction[1, 2] == pytest.approx((1 / (q + 1)).mean().item())
    with pytest.raises(ValueError):
        scores_from_weights(weights, N + 1)


def test_head_scores_run_the_lm_head_on_the_last_position_only(tmp_path, monkeypatch):
    """The probe wants attention weights: no (B, T, V) logits (the default model's probe
    would make 4 x 101 x 49,152 floats, 79 MB)."""
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu")
    rows = []
    real = model.decoder._logits
    monkeypatch.setattr(model.decoder, "_logits", lambda x: rows.append(x.shape[1]) or real(x))
    scores = head_scores(model, repeat_len=5, batch=2)
    assert rows == [1]
    assert len(scores.induction) == model.config.n_layers


def test_repeated_tokens_shape_and_no_specials(default_model):
    ids = repeated_random_tokens(default_model, repeat_len=7, batch=3, seed=1)
    assert ids.shape == (3, 15)
    assert torch.equal(ids[:, 1:8], ids[:, 8:])
    special = set(default_model.tokenizer.all_special_ids)
    assert not special & set(ids[:, 1:].flatten().tolist())


@pytest.mark.slow
def test_captured_weights_equal_attention_on_the_same_inputs(default_model):
    """Recompute layer 0's q/k/v by hand and compare with what the capture saw."""
    ids = torch.tensor([[1, 400, 500, 600, 700, 800]])
    with AttentionCapture(default_model) as cap:
        default_model.logits(ids)
    assert sorted(cap.weights) == list(range(30))
    d = default_model.decoder
    blk = d.blocks[0]
    with torch.no_grad():
        x = blk.attn_norm(d.embed(ids))
        H, Hkv, D = 9, 3, 64
        q, k, v = blk.attn.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(1, 6, H, D).transpose(1, 2)
        k = k.view(1, 6, Hkv, D).transpose(1, 2)
        v = v.view(1, 6, Hkv, D).transpose(1, 2)
        cos, sin = d.rope_cos[:6], d.rope_sin[:6]
        _, w = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, return_weights=True)
    torch.testing.assert_close(cap.weights[0], w)
    # Capture off: nothing is observed.
    assert default_model.decoder.observer is None


@pytest.mark.slow
def test_default_model_has_induction_and_previous_token_heads(default_model):
    s = head_scores(default_model, repeat_len=30, batch=2)
    assert len(s.induction) == 30 and len(s.induction[0]) == 9
    assert s.top("induction", 1)[0][2] > 0.5
    assert s.top("previous_token", 1)[0][2] > 0.5
    flat = torch.tensor(s.induction)
    assert ((flat >= 0) & (flat <= 1)).all()


@pytest.mark.slow
def test_heads_command_json(default_model_file, attnchat_cli):
    status, out, err = attnchat_cli("heads", "--model", str(default_model_file), "--json")
    assert status == 0, err
    data = json.loads(out)
    assert set(data) == {"induction", "previous_token"}
    assert len(data["induction"]) == 30 and all(len(r) == 9 for r in data["previous_token"])
