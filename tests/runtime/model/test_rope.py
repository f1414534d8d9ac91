"""RoPE variants against transformers' own rotary embedding classes (cos and sin per position)."""
from __future__ import annotations

import pytest
import torch

from runtime.config.rope import RopeSpec
from runtime.model.rope import apply_rope, rope_tables, rotation_by

HEAD_DIM = 32
MAX_POS = 64
#: Positions 0..199: inside and past the trained context (the variants differ out there).
POSITIONS = 200


def _llama(rope_parameters: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                       rope_parameters=rope_parameters)


VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + i / 8 for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)]},
}


def _theirs(params: dict, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin for positions 0..end-1 in one forward (a sequence of length ``end``)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _llama(dict(params))
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(end)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("end", [12, POSITIONS])
def test_tables_equal_transformers(name, end):
    params = VARIANTS[name]
    spec = RopeSpec.from_hf(params, max_positions=MAX_POS)
    assert spec.type == params["rope_type"]
    cos, sin = rope_tables(spec, HEAD_DIM, 0, end, seq_len=end)
    want_cos, want_sin = _theirs(params, end)
    # Same float32 operations as transformers: bit-equal, but dynamic past the trained
    # context (its base is a float32 tensor there): one float32 step near 1, 1.2e-7.
    torch.testing.assert_close(cos, want_cos, atol=2e-7, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=2e-7, rtol=0)
    if name != "default" and end == POSITIONS:  # the variant really changes the rotation
        plain = rope_tables(RopeSpec.from_hf(VARIANTS["default"], max_positions=MAX_POS), HEAD_DIM, 0, end)[0]
        assert (plain - cos).abs().max() > 1e-2


def test_partial_rotary_leaves_the_rest_of_the_head_alone():
    spec = RopeSpec.from_hf({"rope_theta": 10000.0}, max_positions=MAX_POS, partial_rotary_factor=0.5)
    cos, sin = rope_tables(spec, HEAD_DIM, 0, 5)
    assert cos.shape == (5, HEAD_DIM // 2)
    x = torch.randn(1, 2, 5, HEAD_DIM)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., HEAD_DIM // 2 :], x[..., HEAD_DIM // 2 :])
    assert not torch.allclose(y[..., : HEAD_DIM // 2], x[..., : HEAD_DIM // 2])


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_rotations_compose(name):
    """R(p + d) = R(d) R(p) without the cos/sin scale: what the rolling policy's re-rotation relies on."""
    spec = RopeSpec.from_hf(VARIANTS[name], max_positions=MAX_POS)
    cos, sin = rope_tables(spec, HEAD_DIM, 0, 40)
    x = torch.randn(1, 1, 1, HEAD_DIM, dtype=torch.float64)
    at_30 = apply_rope(x, cos[30].double(), sin[30].double())
    c, s = rotation_by(spec, HEAD_DIM, -20)
    moved = apply_rope(at_30, c.double(), s.double())
    torch.testing.assert_close(moved, apply_rope(x, cos[10].double(), sin[10].double()), atol=1e-5, rtol=0)
