"""File > Open model file / folder: the dialogs, starting in the models folder."""
from __future__ import annotations

from PySide6.QtWidgets import QFileDialog

import models

__all__ = ["models_folder", "open_file", "open_folder"]


def models_folder() -> str:
    """Where File > Open model… starts: the models folder (:func:`models.models_dir`, where
    downloads go); "" (the current folder) when it cannot be made."""
    try:
        return str(models.models_dir())
    except OSError:
        return ""


def open_file(window) -> None:
    """Ask for a GGUF file and load it in ``window`` (a :class:`MainWindow`)."""
    path, _ = QFileDialog.getOpenFileName(window, "Open a model file", models_folder(),
                                          "GGUF models (*.gguf);;All files (*)")
    if path:
        window.load_model(path)


def open_folder(window) -> None:
    """Ask for a model folder (config.json + safetensors) and load it in ``window``."""
    path = QFileDialog.getExistingDirectory(window, "Open a model folder (config.json + safetensors)", models_folder())
    if path:
        window.load_model(path)
