"""Which catalog model to recommend on this machine: a usable first model.

The default model (SmolLM2-135M, 98 MB) is there for the first minute and offline use, but it
loops. LM Studio and Jan recommend a model for the machine; here it is the catalog's largest
chat model that

- fits: the file plus its KV cache at :data:`QUOTED_CONTEXT` tokens within 80 % of the
  device's free memory (:func:`runtime.fit`'s "fits", sliding windows counted), and the file
  within the model folder's free disk space with 10 % to spare;
- runs at a usable speed: on a CPU at most :data:`CPU_MAX_PARAMETERS` (a 1.5B model's Q4_K_M
  writes several tokens a second on 2 cores; a 7B one about one); on a GPU any size that fits.

Must not import torch or Qt (the fit imports runtime only when called).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable, Iterable

import models
from desktop.model_switcher.hub_jobs import QUOTED_CONTEXT, default_device, default_fit
from desktop.sizes import free_where, size_text

__all__ = ["CPU_MAX_PARAMETERS", "Recommendation", "recommend"]

#: The largest model recommended for a CPU (parameters).
CPU_MAX_PARAMETERS = 2_000_000_000


@dataclass(frozen=True)
class Recommendation:
    """The entry, its fit (:func:`runtime.fit` as a dict) and why, in one sentence."""

    entry: models.CatalogEntry
    fit: dict
    reason: str


def _free_disk() -> int | None:
    try:
        return shutil.disk_usage(models.models_dir()).free
    except OSError:
        return None


def recommend(catalog: Iterable[models.CatalogEntry] | None = None, *, fit: Callable = default_fit,
              device: str | None = None, free_disk: int | None = None,
              installed: Callable | None = None) -> Recommendation | None:
    """The model to recommend (None: none fits besides what is installed).

    Args:
        fit: ``(size_bytes, entry, context, device) -> dict`` (:func:`.hub_jobs.default_fit`).
        device: where it would run (default: what the runtime would pick).
        free_disk: bytes free in the model folder (default: measured).
        installed: ``(entry) -> path or None`` (default :func:`models.installed_path`); an
            installed model is still recommended (it says so) when it is the best.
    """
    entries = [e for e in (catalog or models.CATALOG) if e.chat_template]
    device = device or default_device()
    disk = _free_disk() if free_disk is None else free_disk
    cpu = not str(device).startswith(("cuda", "mps"))
    best: tuple[models.CatalogEntry, dict] | None = None
    for e in entries:
        if cpu and e.parameters > CPU_MAX_PARAMETERS:
            continue
        if disk is not None and e.size_bytes * 1.1 > disk:
            continue
        try:
            f = fit(e.size_bytes, e, min(QUOTED_CONTEXT, e.context_length), device)
        except Exception:  # noqa: BLE001 - a model the planner cannot plan is not recommended
            continue
        if f.get("verdict") != "fits":
            continue
        if best is None or e.parameters > best[0].parameters:
            best = (e, f)
    if best is None:
        return None
    e, f = best
    where = "the CPU" if cpu else str(device)
    reason = (f"the largest chat model in the catalog that fits this machine ({size_text(f['total_bytes'])} with "
              f"its KV cache at {f['context']:,} tokens, of {size_text(f['free_bytes'])} "
              f"{free_where('cpu' if cpu else str(device))})"
              if f.get("free_bytes") else "the largest chat model in the catalog that fits this machine")
    if cpu:
        reason += f" and writes at a usable speed on {where} (at most {CPU_MAX_PARAMETERS / 1e9:.0f}B parameters)"
    return Recommendation(e, f, reason)
