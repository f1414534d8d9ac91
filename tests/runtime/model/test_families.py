"""Our decoder against transformers' own model, on the same tiny random weights, per family.

Each family (Llama with GQA, Mistral, Qwen2 with q/k/v bias, GPT-2) is built by
``tests/runtime/tiny_models.py``, saved with safetensors, loaded by
``runtime.load_model`` and by ``AutoModelForCausalLM.from_pretrained``; both run the
same 24 random token ids.
"""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from tests.runtime.tiny_models import FAMILIES, VOCAB_SIZE, make_tiny_model

SEQ_LEN = 24
PREFILL = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root, family) for family in FAMILIES}


def _ids(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, SEQ_LEN), generator=g)


def _reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(folders, family):
    m = load_model(folders[family], device="cpu", dtype="float32")
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    assert m.config.model_type == family
    if family != "gpt2":
        assert (m.config.n_heads, m.config.n_kv_heads, m.config.head_dim) == (4, 2, 16)  # GQA
    assert m.config.vocab_size == len(m.tokenizer) == VOCAB_SIZE
    ids = _ids(m.config.vocab_size)
    ours = m.logits(ids)
    theirs = _reference_logits(folders[family], ids)
    assert ours.shape == theirs.shape == (1, SEQ_LEN, VOCAB_SIZE)
    assert ours.dtype == torch.float32
    # The logits are O(1) (init std 0.1), so 1e-4 is a tight check, not a trivially met one.
    assert theirs.abs().max() > 0.5
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_stop_tokens(folders, family):
    """Every family's folder gives back the same byte-level tokenizer (Qwen2's included)."""
    m = load_model(folders[family], device="cpu", dtype="float32")
    text = "the cat is very, very happy! Où? 😀"
    ids = m.encode(text)
    assert len(ids) > 10 and max(ids) < VOCAB_SIZE
    assert m.decode(ids) == text
    assert m.has_chat_template
    assert m.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    # <|im_end|> (eos, end of turn) and <|endoftext|>: all inside the vocabulary.
    assert m.stop_token_ids == frozenset({2, 3})


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_cached_steps_equal_full_forward(folders, family):
    m = load_model(folders[family], device="cpu", dtype="float32")
    ids = _ids(m.config.vocab_size)
    full = m.logits(ids)
    cache = m.new_cache(64)
    steps = [m.logits(ids[:, :PREFILL], cache)]
    assert cache.length == PREFILL
    for t in range(PREFILL, SEQ_LEN):
        steps.append(m.logits(ids[:, t : t + 1], cache))
        assert cache.length == t + 1
    cached = torch.cat(steps, dim=1)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
    assert torch.equal(cached.argmax(-1), full.argmax(-1))
    # last_only returns the last position of the same forward.
    cache.crop(SEQ_LEN - 1)
    last = m.logits(ids[:, -1:], cache, last_only=True)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-4, rtol=1e-4)


def test_qwen2_bias_is_loaded_and_matters(folders):
    """The q/k/v bias is really non-zero and really used: without it the logits move."""
    m = load_model(folders["qwen2"], device="cpu", dtype="float32")
    assert m.config.qkv_bias and not m.config.o_bias
    bias = m.decoder.blocks[0].attn.qkv_proj.bias
    assert bias is not None and bias.abs().mean() > 0.3  # torch.randn, not the zero init
    ids = _ids(m.config.vocab_size)
    with_bias = m.logits(ids)
    with torch.no_grad():
        for block in m.decoder.blocks:
            block.attn.qkv_proj.bias.zero_()
    without_bias = m.logits(ids)
    assert (with_bias - without_bias).abs().max() > 1e-2


def test_bfloat16_weights_close_to_float32(folders):
    """bfloat16 weights give logits close to float32's.

    bfloat16 keeps 8 significant bits (relative rounding error up to 2^-8 ~ 0.4% per
    value); each weight, activation and matmul output is rounded, and two blocks plus
    the head compound that, so on logits of size ~2-3 an error of a few hundredths is
    expected (measured: ~0.03 max). atol 0.15 / 5% of the logit range allows that while
    still failing on a wrong weight, a swapped head or a missing bias (errors of O(1)).
    """
    for family in ("llama", "qwen2"):
        m32 = load_model(folders[family], device="cpu", dtype="float32")
        m16 = load_model(folders[family], device="cpu", dtype="bfloat16")
        assert m16.dtype == torch.bfloat16
        assert m16.decoder.embed.weight.dtype == torch.bfloat16
        ids = _ids(m32.config.vocab_size)
        a, b = m32.logits(ids), m16.logits(ids)
        assert b.dtype == torch.float32  # logits come back in float32 either way
        assert not torch.equal(a, b)  # the 16-bit path really ran
        torch.testing.assert_close(b, a, atol=0.15, rtol=0.05)
        assert (b - a).abs().mean() < 0.03
        # Where float32's top choice leads clearly, bfloat16 picks the same token.
        top2 = a.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.1
        assert clear.sum() >= SEQ_LEN // 2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
