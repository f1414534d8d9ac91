"""The settings dialog's Generation tab: the system prompt, a sampling preset and the values
it sets (temperature, top-k/p, min-p, repetition penalty), the reply's length and seed.

A model's file may give its own sampling values (:mod:`models.sampling_defaults`); the
"model's own" choice says which and whether they replace the values here. The preset box is not a setting of its own: it shows which preset the values are
(:func:`desktop.settings.presets.preset_of`, "custom" when none), and choosing one sets them.
Must not import torch.
"""
from __future__ import annotations

from PySide6.QtWidgets import QComboBox, QPlainTextEdit, QVBoxLayout, QWidget

from desktop.settings.presets import PRESET_TEXT, PRESETS, preset_of

__all__ = ["generation_tab", "model_sampling_text", "sync_preset", "system_prompt_texts"]

_NAMES = {"temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
          "repetition_penalty": "repetition penalty"}


def model_sampling_text(model: dict | None) -> str:
    """What the loaded model's file says to sample with, for the hint under that choice."""
    own = (model or {}).get("sampling") or {}
    values = own.get("values") or {}
    if not values:
        name = (model or {}).get("name") if model else None
        return ((f"{name}'s file gives no sampling values" if name else "No model is loaded")
                + ": the values below apply (balanced: temperature 0.7, as LM Studio and Jan).")
    said = ", ".join(f"{_NAMES[k]} {v:g}" for k, v in values.items() if k in _NAMES)
    return f"Its file gives {said} ({own.get('source', 'its file')}): they replace the values below while this is on."


def generation_tab(dialog, note) -> QWidget:
    """The tab's page; its fields go to ``dialog.fields`` (``dialog._add``), the preset box to
    ``dialog.preset``. ``note``: ``(text) -> QLabel`` for the line under the form."""
    page = QWidget()
    v = QVBoxLayout(page)
    form = dialog._form(page)
    prompt = QPlainTextEdit()
    prompt.setMinimumHeight(64)
    prompt.setMaximumHeight(120)
    placeholder, hint = system_prompt_texts(dialog.model)
    prompt.setPlaceholderText(placeholder)
    dialog._add(form, "generation/system_prompt", "System prompt", prompt, hint)
    dialog.preset = QComboBox()
    dialog.preset.setObjectName("generation_preset")
    for name, text in PRESET_TEXT.items():
        dialog.preset.addItem(text, name)
    form.addRow("Preset", dialog.preset)
    dialog._add(form, "generation/model_sampling", "The model's own",
                dialog._combo([(True, "used where its file gives them"), (False, "not used: the values below")]),
                model_sampling_text(dialog.model))
    dialog._add(form, "generation/temperature", "Temperature", dialog._spin(0, 100, "0 (greedy)", step=0.1, decimals=2))
    dialog._add(form, "generation/top_k", "Top-k", dialog._spin(0, 1_000_000, "off"))
    dialog._add(form, "generation/top_p", "Top-p", dialog._spin(0, 1, step=0.05, decimals=2), "1 turns it off.")
    dialog._add(form, "generation/min_p", "Min-p", dialog._spin(0, 1, "off", step=0.01, decimals=2))
    dialog._add(form, "generation/repetition_penalty", "Repetition penalty", dialog._spin(0, 10, step=0.05, decimals=2),
                "1 turns it off; above 1 discourages repeating the last 64 tokens.")
    dialog._add(form, "generation/max_new_tokens", "Max new tokens", dialog._spin(1, 1_000_000, suffix=" tokens", step=64))
    dialog._add(form, "generation/seed", "Seed", dialog._spin(-1, 2**31 - 1, "random"),
                "Random: each reply gets a new seed, shown beside it (its menu reuses it). "
                "The same seed gives the same reply.")
    v.addLayout(form)
    name = (dialog.model or {}).get("name")
    v.addWidget(note("Applies from the next reply." + (
        f" Kept for {name}: the context, system prompt, sampling and cache policy are remembered for each "
        "model file (one never set up starts from the general values)." if name else "")))
    v.addStretch(1)

    def chosen(_index: int) -> None:
        name = dialog.preset.currentData()
        if name in PRESETS:
            for key, value in PRESETS[name].items():
                dialog._set(key, value)
    dialog.preset.activated.connect(chosen)
    return page


def sync_preset(dialog, values: dict) -> None:
    """Show which preset ``values`` (the dialog's) are."""
    i = dialog.preset.findData(preset_of(values))
    if i != dialog.preset.currentIndex():
        dialog.preset.blockSignals(True)
        dialog.preset.setCurrentIndex(i)
        dialog.preset.blockSignals(False)


def system_prompt_texts(model: dict | None) -> tuple[str, str]:
    """(placeholder, hint) for the system prompt: what the model gets when it is left empty.

    An empty setting sends no system message, but a chat template may send its own
    (SmolLM2's: "You are a helpful AI assistant named SmolLM…"); the model info's
    ``builtin_system_prompt`` (:func:`runtime.builtin_system_prompt`) says which.
    """
    info = model or {}
    builtin = info.get("builtin_system_prompt")
    if builtin:
        return (f"None set: the model gets its template's own, \u201c{builtin}\u201d",
                "Left empty, the model's chat template sends its own system prompt (shown greyed above); "
                "anything typed here replaces it.")
    if info.get("remote"):
        return "None set: the server's chat template may send its own", ""
    if not model:
        return "No system prompt (a model's chat template may send its own)", ""
    return "No system prompt: the model gets none", ""
