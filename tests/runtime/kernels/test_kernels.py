"""runtime.kernels: every candidate computes the same product; the choice is timed, kept, and reused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from runtime import load_model
from runtime.kernels import choice as kernels
from runtime.kernels import chooser, cpu, machine
from runtime.kernels.choice import CANDIDATES, FloatKernels, KernelChoice
from runtime.kernels.chooser import load_or_measure
from runtime.kernels.cpu import KERNELS, WeightRef
from runtime.quantize import quantize_int8
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model


def _matrix(dtype: torch.dtype, out: int = 40, inp: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / 8
    if dtype == torch.int8:
        codes, scale = quantize_int8(w)
        return WeightRef(codes, scale.squeeze(1)), codes.float() * scale
    w = w.to(dtype)
    return WeightRef(w), w.float()


def test_int8_dynamic_rounds_activations_too():
    """Not a candidate (it failed the quality bar on the default model), but still a correct
    product up to its 7-bit activations."""
    ref, exact_w = _matrix(torch.int8)
    x = torch.randn(1, 3, 48, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = KERNELS["int8-dynamic"](x, ref, None)
    want = F.linear(x, exact_w)
    err = (got - want).abs().max().item()
    assert 0 < err < 0.05 * want.abs().max().item()
    assert all("int8-dynamic" not in phases for c in CANDIDATES.values() for phases in c.values())


@pytest.mark.parametrize("dtype", list(CANDIDATES))
@pytest.mark.parametrize("rows", [1, 5])
def test_every_candidate_computes_the_product(dtype, rows):
    ref, exact_w = _matrix(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, rows, 48, generator=g)  # float32: what the decoder passes them
    b = torch.randn(40, generator=g)
    want = F.linear(x.float(), exact_w, b.float())
    phase = "decode" if rows == 1 else "prefill"
    ran = 0
    for name in CANDIDATES[dtype][phase]:
        with torch.inference_mode():
            got = KERNELS[name](x, ref, b)
        ran += 1
        assert got.shape == (1, rows, 40) and got.dtype == torch.float32, name
        # int8-dynamic also rounds the activations (7-bit, per call); the 16-bit GEMVs round
        # the input to the weights' dtype: looser bounds for those.
        tol = {"int8-dynamic": 0.05, "f16-gemv": 2e-2, "bf16-gemv": 5e-2}.get(name, 1e-4)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=name)
    assert ran >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_matrix_bigger_than_the_scratch_buffer_is_widened_in_blocks(monkeypatch, dtype, rows):
    """The widening kernels never make a float32 copy of a whole matrix bigger than the
    scratch buffer (the default model's LM head: 113 MB): blocks of rows go through the
    buffer, and the product is the same."""
    import threading

    monkeypatch.setattr(cpu, "SCRATCH_ELEMENTS", 7 * 48)  # 40 rows: blocks of 7, the last of 5
    monkeypatch.setattr(cpu, "_scratch", threading.local())
    seen = []
    real = cpu.widened
    monkeypatch.setattr(cpu, "widened", lambda w, s=None: seen.append(tuple(w.shape)) or real(w, s))
    ref, exact_w = _matrix(dtype)
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(1, rows, 48, generator=g), torch.randn(40, generator=g)
    for name in ("widen-onednn", "widen-mkl"):
        seen.clear()
        with torch.inference_mode():
            got = KERNELS[name](x, ref, b)
        assert seen == [(7, 48)] * 5 + [(5, 48)], name
        torch.testing.assert_close(got, F.linear(x, exact_w, b), rtol=1e-4, atol=1e-4, msg=name)
    assert cpu._scratch.buf.numel() == 7 * 48
    with pytest.raises(ValueError, match="scratch buffer"):
        real(ref.weight, ref.scale)


def test_apply_picks_the_kernel_by_row_count(monkeypatch):
    calls = []
    monkeypatch.setitem(KERNELS, "spy-a", lambda x, r, b: calls.append(("a", x.shape[-2])) or F.linear(x, r.weight))
    monkeypatch.setitem(KERNELS, "spy-b", lambda x, r, b: calls.append(("b", x.shape[-2])) or F.linear(x, r.weight))
    ref, _ = _matrix(torch.float32)
    choice = KernelChoice(decode="spy-a", prefill="spy-b")
    kernels.apply(choice, torch.randn(1, 1, 48), ref, None)
    kernels.apply(choice, torch.randn(1, 3, 48), ref, None)
    assert calls == [("a", 1), ("b", 3)]


def test_measure_picks_the_fastest(monkeypatch):
    import time

    monkeypatch.setitem(KERNELS, "slow", lambda x, r, b: time.sleep(0.002) or F.linear(x, r.weight))
    monkeypatch.setitem(KERNELS, "fast", lambda x, r, b: F.linear(x, r.weight))
    monkeypatch.setitem(KERNELS, "broken", lambda x, r, b: (_ for _ in ()).throw(RuntimeError("not built")))
    monkeypatch.setitem(CANDIDATES, torch.float64, {"decode": ("slow", "fast", "broken"), "prefill": ("broken", "slow")})
    ref, _ = _matrix(torch.float32)
    choice = kernels.measure([(ref, 3)], torch.float64, reps=2)
    assert (choice.decode, choice.prefill) == ("fast", "slow")
    assert set(choice.timings_us["decode"]) == {"slow", "fast"}  # the broken one is skipped
    assert choice.timings_us["decode"]["slow"] >= 3 * 2000  # 3 uses per token x 2 ms
    assert choice.measured


def test_decode_is_timed_streaming_every_matrix_of_a_token_in_order(monkeypatch):
    import time

    seen = []
    monkeypatch.setitem(KERNELS, "slow", lambda x, r, b: seen.append(r) or time.sleep(0.002) or F.linear(x, r.weight))
    monkeypatch.setitem(KERNELS, "fast", lambda x, r, b: F.linear(x, r.weight))
    monkeypatch.setitem(CANDIDATES, torch.float64, {"decode": ("slow", "fast"), "prefill": ("fast",)})
    refs = [_matrix(torch.float32)[0] for _ in range(3)]
    choice = kernels.measure([(refs[0], 2), (refs[2], 1)], torch.float64, reps=2, token_matrices=refs)
    assert choice.decode == "fast"
    # one untimed pass, then 2 timed passes, each through every matrix in order
    assert [refs.index(r) for r in seen] == [0, 1, 2] * 3
    assert choice.timings_us["decode"]["slow"] >= 3 * 2000  # one token: 3 matrices x 2 ms


def test_the_choice_is_kept_per_machine_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "machine_load", lambda: 0.2)  # a quiet machine
    measured = []

    def measure():
        measured.append(1)
        return KernelChoice("mkl", "onednn", timings_us={"decode": {"mkl": 1.0}}, measured=True)

    first = load_or_measure(tmp_path, FloatKernels(torch.float32, measure))
    again = load_or_measure(tmp_path, FloatKernels(torch.float32, measure))
    assert measured == [1] and first == again and not again.measured
    kept = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert kept["choices"]["float32"]["decode"] == "mkl" and kept["cpu"] == machine.cpu_info()["model"]
    load_or_measure(tmp_path, FloatKernels(torch.float16, lambda: KernelChoice("f16-gemv", "widen-mkl")))
    kept = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert set(kept["choices"]) == {"float32", "float16"}
    next(tmp_path.glob("kernels-*.json")).write_text("{not json")
    assert load_or_measure(tmp_path, FloatKernels(torch.float32, measure)) == first and measured == [1, 1]


def test_a_choice_timed_on_a_busy_machine_is_used_but_not_kept(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(machine, "machine_load", lambda: float(os.cpu_count() or 1) + 3)
    choice = load_or_measure(tmp_path, FloatKernels(torch.float32, lambda: KernelChoice("mkl", "mkl", measured=True)))
    assert choice.decode == "mkl" and not list(tmp_path.glob("kernels-*.json"))
    monkeypatch.setattr(machine, "machine_load", lambda: 0.1)
    load_or_measure(tmp_path, FloatKernels(torch.float32, lambda: KernelChoice("onednn", "onednn", measured=True)))
    assert json.loads(next(tmp_path.glob("kernels-*.json")).read_text())["choices"]["float32"]["decode"] == "onednn"


def test_machine_facts():
    info = machine.cpu_info()
    assert info["model"] and isinstance(info["flags"], list)
    assert len(machine.machine_key()) == 16


def test_an_instruction_limit_is_another_machine(monkeypatch):
    """FBGEMM_ENABLE_INSTRUCTIONS=AVX2 (or ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, ...) runs other
    kernels, with other speeds and bits: the choices and verdicts kept for the full set are not its."""
    for name in machine.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = machine.machine_key()
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    avx2 = machine.machine_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert len({plain, avx2, machine.machine_key()}) == 3
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert machine.machine_key() == plain


@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_a_loaded_model_runs_its_choice_and_matches_the_plain_path(tmp_path, dtype):
    model = load_model(make_tiny_model(tmp_path, "llama"), device="cpu", dtype=dtype)
    assert model.kernels is not None and model.kernels.measured
    assert model.kernels.decode in CANDIDATES[model.dtype]["decode"]
    ids = torch.randint(4, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    chosen = model.logits(ids)
    model.decoder.set_kernels(None)
    plain = model.logits(ids)
    if "dynamic" in model.kernels.prefill:  # activations rounded to 7 bits per call: close, not equal
        assert (chosen - plain).abs().max().item() < 0.15 * plain.abs().max().item()
        assert (chosen.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.9
    else:
        torch.testing.assert_close(chosen, plain, rtol=1e-4, atol=1e-4 * plain.abs().max().item())


def test_the_compiled_steps_onednn_op_computes_the_linear_product():
    from runtime.kernels.onednn import register_compiled_op

    register_compiled_op()
    if not hasattr(torch.ops.attnchat, "onednn_linear"):
        pytest.skip("this torch build has no working oneDNN linear op")
    x, w = torch.randn(1, 1, 48), torch.randn(40, 48)
    torch.testing.assert_close(torch.ops.attnchat.onednn_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    register_compiled_op()  # a second probe does not define the op again


@pytest.mark.parametrize("warm_up, calls", [(False, 3), (True, 4)])
def test_best_time_is_the_fastest_call(monkeypatch, warm_up, calls):
    """One timer for the float kernels, the quantized ones and scripts/measure_quant_kernels.py:
    the fastest of ``reps`` timed calls in microseconds, a warm-up call untimed."""
    ticks = iter([0.0, 5e-6, 1.0, 1.0 + 2e-6, 2.0, 2.0 + 7e-6])  # three calls: 5, 2, 7 us
    monkeypatch.setattr(chooser.time, "perf_counter", lambda: next(ticks))
    ran = []
    assert chooser.best_time_us(lambda: ran.append(1), 3, warm_up=warm_up) == pytest.approx(2.0)
    assert len(ran) == calls
