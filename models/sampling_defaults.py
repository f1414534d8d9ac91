"""A model's own sampling values, where its file gives them: a GGUF's ``general.sampling.*``
keys (llama.cpp's converter writes them from the model's generation_config.json: ``temp``,
``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``), or a transformers folder's
``generation_config.json`` (``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``; ``do_sample: false`` means greedy).

Stdlib only. Only numbers in the ranges the settings take are kept (a value outside is left
out, with a log line); a file without any gives ``None``, and the app's own default applies
(the balanced preset, :mod:`desktop.settings.presets`). The GGUF walk is the one bounded reader
(:class:`models.safety.gguf_scan.MetadataReader`), stopping after the ``general.*`` keys the
converter writes first.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from models.safety.custom_code import MAX_JSON_BYTES
from models.safety.gguf_scan import GGUFHeaderError, HeaderStats, MetadataReader

__all__ = ["SamplingDefaults", "read_sampling_defaults"]

log = logging.getLogger(__name__)

#: Each value: (the GGUF key, the generation_config.json key, the least and the most kept).
FIELDS = {
    "temperature": ("general.sampling.temp", "temperature", 0.0, 100.0),
    "top_k": ("general.sampling.top_k", "top_k", 0, 1_000_000),
    "top_p": ("general.sampling.top_p", "top_p", 0.0, 1.0),
    "min_p": ("general.sampling.min_p", "min_p", 0.0, 1.0),
    "repetition_penalty": ("general.sampling.penalty_repeat", "repetition_penalty", 0.0, 10.0),
}
#: How many metadata keys are looked at for them (the converter writes ``general.*`` first);
#: the file's own limits are the bounded reader's (models.safety.gguf_scan).
GENERAL_KEYS_SCANNED = 256


@dataclass(frozen=True)
class SamplingDefaults:
    """What a model's file says to sample with.

    Attributes:
        values: short setting names (``temperature``, ``top_k``, ``top_p``, ``min_p``,
            ``repetition_penalty``) -> numbers; only those the file gives.
        source: where they were read, in words (``"its GGUF's general.sampling.* keys"``).
    """

    values: dict = field(default_factory=dict)
    source: str = ""

    def to_dict(self) -> dict:
        return {"values": dict(self.values), "source": self.source}


def _kept(name: str, value) -> float | int | None:
    lo, hi = FIELDS[name][2:]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if not lo <= value <= hi:
        log.info("the model's sampling value %s=%r is outside %s..%s; not used", name, value, lo, hi)
        return None
    return int(value) if name == "top_k" else float(value)


def _from_gguf(path: Path) -> dict:
    with open(path, "rb") as f:
        r = MetadataReader.of_file(f, HeaderStats())
        r.preamble()
        meta: dict[str, object] = {}
        for i in range(min(r.stats.keys, GENERAL_KEYS_SCANNED)):
            key = r.name(f"metadata key {i}")
            if not key.startswith("general.") and i > 0:
                break
            meta[key] = r.value(r.u32(), f"'{key}'", keep_items=16)
    out = {}
    for name, (gguf_key, *_rest) in FIELDS.items():
        v = _kept(name, meta.get(gguf_key))
        if v is not None:
            out[name] = v
    return out


def _from_config(file: Path) -> dict:
    if file.stat().st_size > MAX_JSON_BYTES:   # the one limit on a model's JSON files (models.safety)
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        return {}
    out = {}
    for name, (_g, key, *_r) in FIELDS.items():
        v = _kept(name, data.get(key))
        if v is not None:
            out[name] = v
    if data.get("do_sample") is False:   # transformers: greedy, whatever the temperature says
        out["temperature"] = 0.0
    return out


def read_sampling_defaults(path: str | Path) -> SamplingDefaults | None:
    """The sampling values the model at ``path`` (a ``.gguf`` file or a transformers folder)
    gives; None when it gives none or cannot be read (never raises: a model without them, or
    with a damaged header, loads and samples with the app's default)."""
    p = Path(path)
    try:
        if p.is_dir():
            config = p / "generation_config.json"
            if not config.is_file() or config.is_symlink():
                return None
            values, source = _from_config(config), "its generation_config.json"
        elif p.is_file():
            values, source = _from_gguf(p), "its GGUF's general.sampling.* keys"
        else:
            return None
    except (OSError, ValueError, GGUFHeaderError) as exc:   # JSONDecodeError is a ValueError
        log.info("could not read the sampling values of %s: %s", p, exc)
        return None
    return SamplingDefaults(values, source) if values else None
