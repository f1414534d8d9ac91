"""Settings > Model says which row-invariant kernel the reproducible mode runs on this machine,
and why (the kernels before it that failed the check here)."""
from __future__ import annotations

import torch
from PySide6.QtWidgets import QLabel

import runtime
from desktop.settings.dialog import SettingsDialog
from desktop.settings.values import Settings
from desktop.worker.model_info import model_info
from runtime.kernels.reproducible import REPRODUCIBLE
from tests.runtime.tiny_models import make_tiny_model


def test_the_settings_name_the_reproducible_kernel_of_this_machine(qtbot, tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    model = runtime.load_model(folder, device="cpu", dtype="float16", reproducible=True)
    info = model_info(model)
    kernel = info["reproducible_kernel"]
    assert kernel == model.kernels.reason
    assert kernel.split(" ")[0] == model.kernels.prefill and model.kernels.prefill in REPRODUCIBLE[torch.float16]
    d = SettingsDialog(Settings(tmp_path / "settings.ini"), info, devices=[("cpu", "CPU")])
    qtbot.addWidget(d)
    label = d.findChild(QLabel, "reproducibleKernel")
    assert label is not None and kernel in label.text()
    fast = model_info(runtime.load_model(folder, device="cpu", dtype="float16"))
    assert fast["reproducible_kernel"] == ""
    plain = SettingsDialog(Settings(tmp_path / "settings2.ini"), fast, devices=[("cpu", "CPU")])
    qtbot.addWidget(plain)
    assert plain.findChild(QLabel, "reproducibleKernel") is None
