"""The prefill kernels' forms built after a load (runtime.model.prefill_forms), on the real
default model: before they are made, prompts run the copy-free default kernel (the logits
of a load that chose it, and the right answer); once made, the chosen kernel (the logits of
a load that made the forms at once); a choice set meanwhile is not undone by the switch."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from runtime import load_model
from runtime.generate.chat_format import Message, encode_messages
from runtime.kernels import ggml_ops
from runtime.kernels import quantized as qk
from runtime.kernels.quant_choice import QuantChoice
from runtime.model import quant_layers
from tests.runtime.session_helpers import greedy_ids

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="the copy-free prefill needs ggml-python")

WIDEN = QuantChoice({"Q4_1": ("ggml", "widen"), "Q8_0": ("ggml", "widen")})
INT4 = QuantChoice({"Q4_1": ("ggml", "int4pack-bf16"), "Q8_0": ("ggml", "widen")})


def _drop_int4_forms(model) -> None:
    for layer in quant_layers.quant_layers(model.decoder):
        for p in layer.parts:
            p.prepared = {k: v for k, v in p.prepared.items() if not k.startswith("int4pack")}


def _prefill_kernels(model) -> set[str]:
    return {run[3] for layer in quant_layers.quant_layers(model.decoder)[:-1] for run in layer._runs[1]
            if run[2].btype.name == "Q4_1"}


@pytest.fixture(scope="module")
def model(default_model_file):
    m = load_model(default_model_file, device="cpu", threads=1)
    assert m.prefill_forms is not None and m.prefill_forms.wait(120)
    return m


@pytest.fixture
def hold(monkeypatch):
    """``hold()``: from then on int4pack's repack waits for the event it returns (the builder is
    held before its first form); set at the test's end."""
    events = []

    def hold_repacks() -> threading.Event:
        event = threading.Event()
        kernel = qk.QUANT_KERNELS["int4pack-bf16"]

        def held(w, device):
            event.wait(120)
            return kernel.prepare(w, device)

        monkeypatch.setitem(qk.QUANT_KERNELS, "int4pack-bf16", dataclasses.replace(kernel, prepare=held))
        events.append(event)
        return event

    yield hold_repacks
    for event in events:
        event.set()


def _france(model) -> str:
    ids = encode_messages(model.tokenizer, [Message("user", "What is the capital of France?")])
    return model.decode(greedy_ids(model, ids, 10))


def test_prompts_wait_for_nothing_and_switch_once_the_forms_are_made(model, hold):
    ids = encode_messages(model.tokenizer, [Message("user", "Name three colours.")])
    quant_layers.set_choice(model.decoder, WIDEN, "cpu")
    widened = model.logits(ids)
    quant_layers.set_choice(model.decoder, INT4, "cpu")   # the forms made at once
    repacked = model.logits(ids)
    assert not torch.equal(widened, repacked)   # the kernels differ: which one ran shows in the logits
    _drop_int4_forms(model)

    gate = hold()
    forms = quant_layers.set_choice(model.decoder, INT4, "cpu", background=True)
    assert forms.state == "building" and len(forms) == 120   # every Q4_1 matrix of the 30 layers
    assert _prefill_kernels(model) == {"widen"}
    assert torch.equal(model.logits(ids), widened)
    assert "Paris" in _france(model)

    gate.set()
    assert forms.wait(120) and forms.state == "ready"
    assert _prefill_kernels(model) == {"int4pack-bf16"}
    assert torch.equal(model.logits(ids), repacked)
    assert "Paris" in _france(model)


def test_a_choice_set_while_building_stays(model, hold):
    _drop_int4_forms(model)
    gate = hold()
    forms = quant_layers.set_choice(model.decoder, INT4, "cpu", background=True)
    assert forms.state == "building"
    quant_layers.set_choice(model.decoder, WIDEN, "cpu")
    gate.set()
    assert forms.wait(120)
    assert _prefill_kernels(model) == {"widen"}


def test_nothing_to_build_is_ready_at_once(model):
    """Kernels that read the blocks themselves are not left to the builder (ggml-exact's form is
    a view of them): they run at once."""
    exact = QuantChoice({"Q4_1": ("ggml", "ggml-exact"), "Q8_0": ("ggml", "widen")})
    for choice, kernel in ((WIDEN, "widen"), (exact, "ggml-exact")):
        forms = quant_layers.set_choice(model.decoder, choice, "cpu", background=True)
        assert forms.state == "ready" and forms.ready.is_set() and len(forms) == 0
        assert _prefill_kernels(model) == {kernel}
