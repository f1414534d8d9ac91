"""Default dtypes are chosen by measurement (runtime.device.default_dtype).

Each dtype the app picks by default on any device (the CPU, CUDA, Apple MPS) runs here
on the CPU with that device's arithmetic (weights' dtype and compute dtype), and must
answer the Paris question and agree with float32 on at least 98 % of greedy tokens over
a few hundred positions of English text and of a chat. The figures the settings show
(runtime.device.WEIGHT_DTYPE_QUALITY) are checked against the same measurement.
"""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.device import WEIGHT_DTYPE_QUALITY, compute_dtype, default_dtype
from runtime.dtypes import parse_weight_dtype
from runtime.generate.chat_format import Message, encode_messages
from tests.runtime.session_helpers import greedy_ids

pytestmark = pytest.mark.slow

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
        "fifty years, presses had spread to more than two hundred European cities, and the "
        "price of books fell sharply. Scholars argue about how much this changed literacy, "
        "religion and science, but few doubt that it changed them. ") * 2 + (
        "Water boils at one hundred degrees Celsius at sea level. The capital of Italy is Rome, and "
        "the capital of Spain is Madrid. In 1969 two astronauts walked on the Moon. ") * 2
CHAT = [Message("system", "You are a helpful assistant."), Message("user", "Name three rivers in Europe."),
        Message("assistant", "The Danube, the Rhine and the Seine."), Message("user", "Which is the longest?")]


@pytest.fixture(scope="module")
def text_ids(default_model):
    return default_model.encode(TEXT)  # 227 positions


@pytest.fixture(scope="module")
def chat_ids(default_model):
    return encode_messages(default_model.tokenizer, CHAT)


def _answer(model) -> str:
    ids = encode_messages(model.tokenizer, [Message("user", "What is the capital of France?")])
    return model.decode(greedy_ids(model, ids, 12))


@pytest.fixture(scope="module")
def measure(default_model, default_model_file, text_ids, chat_ids):
    """``measure(weights, compute)``: the agreement with float32 on the text and on the chat,
    and the answer to the Paris question, of the default model loaded with those dtypes.
    Each pair is measured once per module: the CPU's default is also a settings row, and
    CUDA's and MPS's defaults are the same pair (float32's greedy tokens computed once)."""
    reference = {"text": default_model.logits(text_ids)[0].argmax(-1),
                 "chat": default_model.logits(chat_ids)[0].argmax(-1)}
    done: dict[tuple[torch.dtype, torch.dtype], tuple[float, float, str]] = {}

    def agreement(model, ids, which) -> float:
        return (model.logits(ids)[0].argmax(-1) == reference[which]).float().mean().item()

    def run(weights, compute: torch.dtype) -> tuple[float, float, str]:
        key = (parse_weight_dtype(weights), compute)
        if key not in done:
            model = load_model(default_model_file, device="cpu", dtype=weights, compute=compute)
            done[key] = (agreement(model, text_ids, "text"), agreement(model, chat_ids, "chat"), _answer(model))
        return done[key]

    return run


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_each_devices_default_dtype_answers_right(device, measure):
    weights = default_dtype(device)
    compute = compute_dtype(device, weights)
    assert weights != torch.bfloat16 and compute != torch.bfloat16  # measured to break the model (below)
    text, chat, answer = measure(weights, compute)
    assert "Paris" in answer
    assert text >= 0.98 and chat >= 0.98, (text, chat)


def test_the_settings_figures_match_a_fresh_measurement(measure):
    """What the settings show beside each weight dtype is what this machine measures
    (agreement within 1.5 points: other CPUs round float16/bfloat16 slightly differently)."""
    for name, figures in WEIGHT_DTYPE_QUALITY.items():
        text, _chat, answer = measure(name, compute_dtype("cpu", name))
        assert abs(text - figures["agreement"]) <= 0.015, (name, text)
        assert ("Paris" in answer) == figures["paris"], (name, answer)
