"""Sampling presets: what a reply is drawn with, by name (precise, balanced, creative, greedy).

``balanced`` is the desktop's default, close to what LM Studio, Jan and llama.cpp ship
(temperature 0.7-0.8, top-k 40, top-p 0.95, min-p 0.05; LM Studio's repeat penalty 1.1): a
chat app samples, so Regenerate gives another reply. ``greedy`` (temperature 0) takes the
most likely token every step: the same conversation gets the same reply (docs/reproducible.md).
Plain data: must not import torch or Qt.
"""
from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "PRESET_KEYS", "PRESET_TEXT", "DEFAULT_PRESET", "preset_of"]

#: The settings a preset sets (``generation/*`` keys).
PRESET_KEYS = ("generation/temperature", "generation/top_k", "generation/top_p", "generation/min_p",
               "generation/repetition_penalty")

PRESETS: dict[str, dict[str, float]] = {
    "precise": {"generation/temperature": 0.3, "generation/top_k": 40, "generation/top_p": 0.9,
                "generation/min_p": 0.05, "generation/repetition_penalty": 1.1},
    "balanced": {"generation/temperature": 0.7, "generation/top_k": 40, "generation/top_p": 0.95,
                 "generation/min_p": 0.05, "generation/repetition_penalty": 1.1},
    "creative": {"generation/temperature": 1.0, "generation/top_k": 100, "generation/top_p": 0.98,
                 "generation/min_p": 0.02, "generation/repetition_penalty": 1.05},
    "greedy": {"generation/temperature": 0.0, "generation/top_k": 0, "generation/top_p": 1.0,
               "generation/min_p": 0.0, "generation/repetition_penalty": 1.0},
}
DEFAULT_PRESET = "balanced"

PRESET_TEXT = {
    "precise": "precise: temperature 0.3 (factual answers, little variety)",
    "balanced": "balanced: temperature 0.7 (the default; as LM Studio and Jan)",
    "creative": "creative: temperature 1.0 (stories, brainstorming)",
    "greedy": "greedy: always the most likely token (the same reply every time)",
    "custom": "custom (the values below)",
}


def preset_of(values: dict[str, Any]) -> str:
    """The preset whose values ``values`` has (``"custom"`` when none). Greedy is any temperature 0:
    the other filters do not change the most likely token."""
    if float(values.get("generation/temperature", 0.0)) == 0.0:
        return "greedy"
    for name, preset in PRESETS.items():
        if all(abs(float(values.get(k, 0.0)) - float(v)) < 1e-9 for k, v in preset.items()):
            return name
    return "custom"
