"""The default model answers the canonical questions right from its own blocks, whichever
kernels this machine may choose for them (runtime.kernels.quant_choice.kernel_pairs: the
choice is timed per machine, so every pair it may pick is asked here), with the template's
built-in system prompt and with an empty one.

Why every pair: ggml rounds a product's activations to 8 bits per block, and where that
rounding runs decides answers. "What is the capital of France?" opens with a near-tie (float32
logits 25.325 "The" / 25.243 "L"): the prompt's products rounded through ggml
answer "L'Étoile, la Cité, la Nation" (AMD EPYC Zen 3 and Zen 4, ggml's AVX2 and AVX-512 kernels),
while exact prompt products answer "The capital of France is Paris." on every CPU measured.
"""
from __future__ import annotations

import pytest

from runtime import load_model
from runtime.generate.chat_format import Message, encode_messages
from runtime.kernels.quant_choice import QuantChoice, kernel_pairs
from runtime.model import quant_layers
from tests.runtime.session_helpers import greedy_ids

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Write a one-line poem about the sea."]
SYSTEMS = [None, ""]  # the template's built-in system prompt; an empty one


def _reply(model, question: str, system: str | None, n: int = 12) -> str:
    msgs = ([] if system is None else [Message("system", system)]) + [Message("user", question)]
    return model.decode(greedy_ids(model, encode_messages(model.tokenizer, msgs), n))


@pytest.fixture(scope="module")
def blocks(default_model_file):
    return load_model(default_model_file, device="cpu")


@pytest.fixture(scope="module")
def float32_poems(default_model):
    return {s: _reply(default_model, QUESTIONS[2], s).split()[0] for s in SYSTEMS}


def _choices(model) -> list[QuantChoice]:
    """Every pair the chooser may pick for each block type, all types at once: the i-th choice
    runs every type's i-th pair (its first where it has fewer). All the roundings of a kind
    together are the hardest case; each combination of types would take the product of their
    pair counts in runs, and on the default file the second type (Q8_0) is only the embedding
    and the tied LM head, which sees one row per prompt (through the decode kernel)."""
    btypes = sorted({p.btype for layer in quant_layers.quant_layers(model.decoder) for p in layer.parts},
                    key=lambda t: t.name)
    pairs = {t.name: kernel_pairs(t, "cpu") for t in btypes}
    widest = max(len(p) for p in pairs.values())
    return [QuantChoice({n: p[i] if i < len(p) else p[0] for n, p in pairs.items()}) for i in range(widest)]


def test_every_kernel_choice_answers_right(blocks, float32_poems):
    wrong = []
    for choice in _choices(blocks):
        quant_layers.set_choice(blocks.decoder, choice, "cpu")
        for system in SYSTEMS:
            france, four, poem = (_reply(blocks, q, system) for q in QUESTIONS)
            if "Paris" not in france:
                wrong.append(f"{choice.kernels}, system {system!r}: {france!r}")
            if "4" not in four:
                wrong.append(f"{choice.kernels}, system {system!r}: {four!r}")
            if poem.split()[:1] != [float32_poems[system]]:
                wrong.append(f"{choice.kernels}, system {system!r}: {poem!r} (float32: {float32_poems[system]!r} ...)")
    assert not wrong, "\n".join(wrong)


def _stepped_reply(model, question: str, system: str | None, n: int = 12) -> str:
    """Greedy through the model's own decode step (:meth:`Model.decode_next`), as a chat runs."""
    msgs = ([] if system is None else [Message("system", system)]) + [Message("user", question)]
    ids = encode_messages(model.tokenizer, msgs)
    cache = model.new_cache(len(ids) + n + 1)
    logits = model.logits(ids, cache, last_only=True)
    out: list[int] = []
    while len(out) < n:
        token = int(logits[0, -1].argmax())
        if token in model.stop_token_ids:
            break
        out.append(token)
        logits = model.decode_next(token, cache)
    return model.decode(out)


def test_the_default_decode_step_answers_right(default_model_file, float32_poems):
    from runtime.kernels import ggml_ops

    model = load_model(default_model_file, device="cpu")
    assert model.decode_mode == ("ggml" if ggml_ops.available() else "eager")
    wrong = []
    for system in SYSTEMS:
        france, four, poem = (_stepped_reply(model, q, system) for q in QUESTIONS)
        if "Paris" not in france or "4" not in four or poem.split()[:1] != [float32_poems[system]]:
            wrong.append(f"{model.decode_mode}, system {system!r}: {france!r} / {four!r} / {poem!r}")
    assert not wrong, "\n".join(wrong)
