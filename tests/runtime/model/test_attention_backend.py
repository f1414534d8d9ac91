"""The attention backend switch: the reference and fast paths give the same logits."""
from __future__ import annotations

import pytest
import torch

import runtime
from runtime import load_model
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model


@pytest.fixture
def restore_backend():
    before = runtime.get_attention_backend()
    yield
    runtime.set_attention_backend(before)


def test_both_backends_give_the_same_logits(tmp_path, restore_backend):
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32")
    ids = torch.randint(0, VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {}
    for name in runtime.ATTENTION_BACKENDS:
        runtime.set_attention_backend(name)
        assert runtime.get_attention_backend() == name
        cache = model.new_cache(32)
        prefill = model.logits(ids[:12], cache)            # a block of queries
        steps = [model.logits([t], cache) for t in ids[12:]]  # one query at a time, cached keys
        out[name] = torch.cat([prefill[0], *(s[0] for s in steps)])
    torch.testing.assert_close(out["reference"], out["fast"], atol=1e-4, rtol=1e-4)


def test_unknown_backend_is_refused(restore_backend):
    with pytest.raises(ValueError, match="reference, fast"):
        runtime.set_attention_backend("flash")
    assert runtime.get_attention_backend() in runtime.ATTENTION_BACKENDS
