"""Quality of 8-bit weights and of the 8-bit KV cache on the real default model.

The bar: the model still answers "Paris", and at least 98 % of greedy tokens agree with
float32 over a few hundred positions of English text, teacher-forced (the int8 cache's 32
tokens a forward: see test_int8_cache_agrees_with_float32), as test_float16_weights measured
float16. The int8 cache also has to recall a fact placed about 3,000 tokens back. Truth is our float32 engine,
itself checked against transformers (test_default_model).
"""
from __future__ import annotations

import pytest
import torch

from runtime import ChatSession, GenerationSettings, Message, SamplingParams, load_model
from runtime.memory.planner import weights_bytes
from runtime.generate.chat_format import encode_messages

pytestmark = pytest.mark.slow

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
        "fifty years, presses had spread to more than two hundred European cities, and the "
        "price of books fell sharply. Scholars argue about how much this changed literacy, "
        "religion and science, but few doubt that it changed them. ")
#: About 400 tokens of plain English, no repeats (a repeated passage is easy to copy).
ESSAY = (
    "Rivers have shaped where people live for as long as there have been people. A river brings "
    "fresh water for drinking and farming, fish for food, and a road for boats long before there "
    "were paved roads on land. The first large cities grew up beside the Nile, the Tigris and the "
    "Euphrates, the Indus and the Yellow River, and each of them depended on the floods that left "
    "rich soil on the fields every year. When the floods came late or too high, harvests failed and "
    "kingdoms could fall. Engineers therefore learned very early to build canals, dikes and "
    "reservoirs, and to keep careful records of the water level. Some of the oldest written "
    "documents we have are lists of rations, taxes and flood heights. Today most large rivers are "
    "controlled by dams, which store water for dry seasons and turn its fall into electricity. Dams "
    "also trap the mud that once fed the fields downstream, block the fish that swim upriver to lay "
    "their eggs, and flood valleys where villages stood. Deciding how to share a river between "
    "farmers, cities, factories and the countries it crosses is one of the hardest problems that "
    "governments face. Agreements such as the treaty on the Indus, signed in 1960, have survived "
    "wars, while other disputes have lasted for decades. Climate change adds a new difficulty: "
    "glaciers that feed many Asian rivers are shrinking, and rain falls in shorter, heavier storms. "
    "Planners now have to prepare for both floods and droughts in the same basin. Some cities are "
    "giving rivers more room again, removing old walls and letting the water spread over parks and "
    "meadows when it rises, so that streets and houses stay dry. Others restore wetlands, which soak "
    "up water like a sponge and release it slowly. None of these choices is free, but each one "
    "shows that people are still learning to live with rivers rather than simply against them."
)


@pytest.fixture(scope="module")
def model8(default_model_file):
    return load_model(default_model_file, device="cpu", dtype="int8")


@pytest.fixture(scope="module")
def text_ids(default_model):
    return default_model.encode(ESSAY)


@pytest.fixture(scope="module")
def float32_logits(default_model, text_ids):
    """float32's logits predicting the essay's tokens after the first, ``(len - 1, V)``: one prefill."""
    return default_model.logits(text_ids)[0, 1:]


def teacher_forced(model, ids: list[int], cache_dtype: str | None = None, chunk: int = 1) -> torch.Tensor:
    """Logits ``(len(ids) - 1, V)`` predicting ids[1:], read ``chunk`` tokens a forward (1: one
    token per step, the decode path). Every forward writes its tokens' keys and values into the
    cache before attending (:meth:`runtime.cache.kv_cache.KVCache.update`), so in an int8 cache
    every query, in a chunk or alone, attends to keys and values read back from int8."""
    cache = model.new_cache(len(ids), dtype=cache_dtype)
    return torch.cat([model.logits(ids[i:i + chunk], cache)[0] for i in range(0, len(ids), chunk)])[1:]


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def answer(model, question: str, cache_dtype: str | None = None, max_new_tokens: int = 24) -> str:
    s = ChatSession(model, settings=GenerationSettings(max_new_tokens=max_new_tokens, cache_dtype=cache_dtype,
                                                       sampling=SamplingParams(temperature=0.0)))
    return s.run(s.send(question)).text


def test_int8_weights_are_a_quarter_of_float32(model8, default_model):
    assert model8.dtype == torch.int8 and model8.compute_dtype == torch.float32
    assert model8.decoder.blocks[0].mlp.gate_up_proj.weight.dtype == torch.int8
    # int8 codes for every matrix (embeddings tied to the head: once), a float32 scale per row,
    # float32 norm weights (61 x 576).
    n = sum(p.numel() for p in default_model.decoder.parameters())
    norms = 61 * 576
    rows = 49152 + 30 * (960 + 576 + 2 * 1536 + 576)
    assert model8.weights_bytes == (n - norms) + norms * 4 + rows * 4
    assert weights_bytes(model8.config, "int8") == model8.weights_bytes  # the planner's figure is exact
    assert weights_bytes(model8.config, "float32") == default_model.weights_bytes
    assert model8.kernels is not None


def test_int8_weights_agree_with_float32(model8, float32_logits, text_ids):
    """Measured on an AMD EPYC Zen 3, one prefill over the 371 positions (the
    weight-only kernels compute the same product token by token): 95.7 %, mean |logit
    difference| 0.18, max 1.59: under the 98 % bar, so int8 weights are not the
    default. The bound is what was measured, so a regression fails; the bar is not claimed."""
    ref = float32_logits
    got = model8.logits(text_ids)[0, 1:]
    assert agreement(got, ref) >= 0.95
    assert (got - ref).abs().mean().item() < 0.25


def test_int8_cache_agrees_with_float32(default_model, float32_logits, text_ids):
    """Measured on an AMD EPYC Zen 3 over the 371 positions: read 32 tokens a forward, 98.7 %
    of greedy tokens agree, mean |logit difference| 0.068, max 0.86; one token a step (the
    decode path, 150x the time on the 2-vCPU test machine) 98.1 %, 0.066, 0.80: the same
    rounding, since either way every key and value attended was read back from int8. The
    bound is what was measured, so a regression fails."""
    ref = float32_logits
    steps = teacher_forced(default_model, text_ids, cache_dtype="int8", chunk=32)
    assert agreement(steps, ref) >= 0.975
    assert (steps - ref).abs().mean().item() < 0.1


def test_int8_cache_answers_paris(default_model):
    assert "Paris" in answer(default_model, "What is the capital of France?", cache_dtype="int8")


def test_int8_cache_recalls_a_fact_3000_tokens_back(default_model):
    """A name given at the start of a ~3,000-token message, asked for at its end."""
    text = "Remember this: my cat is called Biscuit. " + TEXT * 41 + "\n\nWhat is my cat called?"
    n = len(encode_messages(default_model.tokenizer, [Message("user", text)]))
    assert 2900 < n < 3300
    assert "Biscuit" in answer(default_model, text, cache_dtype="int8", max_new_tokens=16)
