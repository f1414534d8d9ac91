"""Each cache policy on a hand-made attention pattern: exactly which positions it keeps."""
from __future__ import annotations

import pytest
import torch

from runtime.cache.policies import (
    CACHE_POLICIES,
    LayerObservation,
    PolicyParams,
    choose,
    keep_slots,
)
from runtime.cache.policies.snapkv import SnapKV


def _positions(*rows: list[int]) -> torch.Tensor:
    """(1, Hkv, T) positions, one row per KV head."""
    return torch.tensor([list(r) for r in rows]).unsqueeze(0)


def _kept(slots: torch.Tensor, positions: torch.Tensor) -> list[list[int]]:
    return positions.gather(-1, slots)[0].tolist()


def test_sinks_window_keeps_the_first_tokens_and_the_newest():
    pos = _positions(range(12))
    slots = choose("sinks-window", LayerObservation(pos), 7, PolicyParams(sink_tokens=4))
    assert _kept(slots, pos) == [[0, 1, 2, 3, 9, 10, 11]]
    # After an earlier eviction the slots are not positions: the policy reads positions.
    pos = _positions([0, 1, 2, 3, 20, 21, 22, 30, 31])
    assert _kept(choose("sinks-window", LayerObservation(pos), 6, PolicyParams(sink_tokens=2)), pos) == [[0, 1, 21, 22, 30, 31]]


def test_h2o_keeps_heavy_hitters_and_a_recent_window_per_head():
    pos = _positions(range(10), range(10))
    acc = torch.zeros(1, 2, 10)
    acc[0, 0, [1, 4, 6]] = torch.tensor([3.0, 2.0, 1.0])  # head 0's heavy hitters: 1 > 4 > 6
    acc[0, 1, [0, 2, 5]] = torch.tensor([1.0, 5.0, 4.0])  # head 1's: 2 > 5 > 0
    obs = LayerObservation(pos, accumulated=acc)
    # budget 6, half recent: positions 7, 8, 9 and the three heaviest others.
    assert _kept(choose("h2o", obs, 6), pos) == [[1, 4, 6, 7, 8, 9], [0, 2, 5, 7, 8, 9]]
    # No recent share: the four heaviest, and the newest token (always kept).
    assert _kept(choose("h2o", obs, 4, PolicyParams(h2o_recent=0.0)), pos) == [[1, 4, 6, 9], [0, 2, 5, 9]]


def test_tova_keeps_the_current_queries_favourites_the_same_in_every_head():
    pos = _positions(range(8), range(8))
    att = torch.zeros(1, 4, 1, 8)  # 4 query heads over 2 KV heads, one query
    att[0, 0, 0, 2] = 0.9          # head 0 looks at 2
    att[0, 3, 0, 5] = 0.6          # head 3 (KV head 1) looks at 5
    att[0, 1, 0, 3] = 0.3
    att[0, :, 0, 7] = 0.05
    slots = choose("tova", LayerObservation(pos, recent_attention=att), 4)
    # the mean over all 4 heads ranks 2 > 5 > 3; 7 (the newest) is kept anyway.
    assert _kept(slots, pos) == [[2, 3, 5, 7], [2, 3, 5, 7]]


def test_snapkv_pools_the_windows_attention_and_keeps_the_window():
    T, W = 16, 3
    pos = _positions(range(T))
    att = torch.zeros(1, 2, W, T)  # 2 query heads, 1 KV head
    att[0, 0, :, 4] = 1.0           # every window query of head 0 looks at 4
    att[0, 1, 0, 10] = 0.9          # one window query of head 1 looks at 10
    obs = LayerObservation(pos, recent_attention=att)
    params = PolicyParams(snap_window=W, snap_kernel=3)
    s = SnapKV.from_params(params).score(obs, 7)[0, 0]
    # mean over the 3 queries, then a width-3 average pool, then the mean over the 2 heads:
    assert s[4].item() == pytest.approx((1.0 / 3) / 2)
    assert s[3].item() == s[5].item() == pytest.approx((1.0 / 3) / 2)
    assert s[10].item() == pytest.approx((0.3 / 3) / 2)
    assert s[9].item() == s[11].item() == pytest.approx((0.3 / 3) / 2)
    assert torch.isinf(s[13:]).all()  # the window
    # 7 kept: the window (13, 14, 15), then 3, 4, 5 (pooled from 4), then 11 (ties: newer wins)
    assert _kept(choose("snapkv", obs, 7, params), pos) == [[3, 4, 5, 11, 13, 14, 15]]


def test_key_norm_keeps_the_lowest_norm_keys_per_head():
    pos = _positions(range(6), range(6))
    norms = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    keys = torch.zeros(1, 2, 6, 4)
    keys[0, :, :, 0] = norms
    keys[0, :, :, 1] = 0.0
    slots = choose("key-norm", LayerObservation(pos, keys=-keys), 3)  # a sign does not change a norm
    assert _kept(slots, pos) == [[1, 3, 5], [0, 1, 5]]  # the two lowest norms, and the newest (5)


def test_none_keeps_the_newest_when_forced_and_each_policy_needs_its_observation():
    pos = _positions(range(5))
    assert _kept(choose("none", LayerObservation(pos), 3), pos) == [[2, 3, 4]]
    for name in ("h2o", "tova", "snapkv", "key-norm"):
        with pytest.raises(ValueError, match=name):
            choose(name, LayerObservation(pos), 3)
    with pytest.raises(ValueError, match="unknown cache policy 'lru'"):
        choose("lru", LayerObservation(pos), 3)
    assert set(CACHE_POLICIES) == {"none", "sinks-window", "h2o", "snapkv", "tova", "key-norm"}


def test_keep_slots_orders_by_position_breaks_ties_to_newer_and_checks_the_count():
    pos = _positions([0, 3, 7, 8, 12])
    score = torch.tensor([[[1.0, 1.0, 1.0, 0.0, 0.0]]])
    assert keep_slots(score, pos, 3)[0].tolist() == [[1, 2, 4]]  # 12 (newest), then 7 and 3 of the tied ones
    with pytest.raises(ValueError, match="cannot keep 6 of 5"):
        keep_slots(score, pos, 6)
