"""The one kernel chooser: float matrices and a GGUF's blocks kept in one file per machine,
each in its own part, with the machine's key as it has always been computed."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from runtime.kernels import machine
from runtime.kernels.choice import FloatKernels, KernelChoice
from runtime.kernels.chooser import load_or_measure
from runtime.kernels.quant_choice import BlockKernels, QuantChoice, default_quant_choice, kernel_pairs
from runtime.kernels.threads import max_threads
from runtime.weights.quant_types import BLOCK_TYPES


def test_the_machine_key_is_the_one_older_choice_files_are_named_by(monkeypatch):
    for name in machine.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    info = machine.cpu_info()
    raw = json.dumps([machine.CHOICE_VERSION, info["model"], info["flags"], torch.__version__, max_threads()])
    assert machine.machine_key() == hashlib.sha1(raw.encode()).hexdigest()[:16]
    assert machine.kernel_file(None) is None


def test_float_and_block_choices_share_the_machines_file(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNCHAT_KERNELS", raising=False)
    monkeypatch.setattr(machine, "machine_load", lambda: 0.1)
    q8 = BLOCK_TYPES["Q8_0"]
    pair = kernel_pairs(q8, "cpu")[-1]
    measured = []

    def measure():
        measured.append(1)
        return QuantChoice({"Q8_0": pair}, timings_us={"Q8_0": {"decode": {pair[0]: 5.0}}}, measured=True)

    load_or_measure(tmp_path, FloatKernels(torch.float32, lambda: KernelChoice("mkl", "onednn", measured=True)))
    first = load_or_measure(tmp_path, BlockKernels({q8}, "cpu", measure))
    again = load_or_measure(tmp_path, BlockKernels({q8}, "cpu", measure))
    assert measured == [1] and again.kernels == {"Q8_0": pair} and not again.measured
    kept = json.loads(machine.kernel_file(tmp_path).read_text())
    assert kept["quant"]["Q8_0"]["pair"] == list(pair) and kept["choices"]["float32"]["decode"] == "mkl"
    assert first.kernels == again.kernels


def test_block_kernels_off_the_cpu_or_on_a_busy_machine_are_the_defaults_unmeasured(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNCHAT_KERNELS", raising=False)
    q4 = BLOCK_TYPES["Q4_0"]
    never = lambda: (_ for _ in ()).throw(AssertionError("measured"))  # noqa: E731
    assert load_or_measure(tmp_path, BlockKernels({q4}, "cuda", never)) == default_quant_choice({q4}, "cuda")
    monkeypatch.setattr(machine, "machine_load", lambda: float(os.cpu_count() or 1) + 3)
    assert load_or_measure(tmp_path, BlockKernels({q4}, "cpu", never)) == default_quant_choice({q4}, "cpu")
    assert not list(tmp_path.glob("kernels-*.json"))
