"""A repo's GGUF files as the command line (``attnchat models files``) and the app's Hub
browser show them: each file's size, quant, whether it is here, and its fit on this machine.

The fit itself comes from the caller (:func:`runtime.fit`, the memory planner, which this
package may not import): ``fit(size_bytes, shape, context, block_type) -> dict``; so does whether each
quant runs here (:func:`runtime.quant_support`): ``runs(block_type) -> dict`` for the block
type its tag names (:func:`.ref.tag_block_type`), and a quant that runs widened is fitted
with the float16 copies' bytes added. The model's shape is
read once, from the smallest single-file GGUF's header (every quant of a repo is the same
model). Imports huggingface_hub only through :mod:`.api`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from models.errors import HubError

from . import api
from .ref import tag_block_type
from .local import installed_files, partial_bytes

__all__ = ["QUOTED_CONTEXT", "files_report"]

log = logging.getLogger(__name__)

QUOTED_CONTEXT = 8192
"""The context a fit is quoted at by default (tokens; capped by the model's own)."""

FitFn = Callable[[int, Any, int, str], dict]
RunsFn = Callable[[str], dict]


def _runs(runs: RunsFn | None, quant: str, size_bytes: int) -> dict | None:
    """``runs(block type)`` of a file's tag with ``block_type`` and ``extra_bytes`` (the float16
    copies of a widened run: 2 bytes a weight, the weights from the file's bytes and the
    type's bits per weight), or None without ``runs`` or a tag."""
    from .ref import tag_block_type

    if runs is None or not quant:
        return None
    btype = tag_block_type(quant)
    r = dict(runs(btype)) if btype else {"block_type": "", "runs": "no", "kernel": "", "bits_per_weight": 0.0,
                                         "why": f"{quant} names no block type attnchat knows"}
    bpw = r.get("bits_per_weight") or 0
    r["extra_bytes"] = int(size_bytes * 8 / bpw) * 2 if r["runs"] == "widened" and bpw else 0
    return r


def files_report(repo_id: str, *, revision: str = "main", fit: FitFn | None = None,
                 context: int | None = None, listing: Callable = None, shape: Callable = None,
                 runs: RunsFn | None = None) -> dict:
    """``repo_id``'s GGUF models with sizes, quants, whether each runs here, and fits.

    Args:
        fit: ``fit(size_bytes, shape, context, block_type) -> dict`` (None: no fits); the
            file's block type (:func:`.ref.tag_block_type`, "" when its tag names none) sets the
            cache dtype a run from its blocks takes.
        runs: ``runs(block_type) -> dict`` with ``runs`` ("blocks", "widened", "no"), ``kernel``,
            ``bits_per_weight`` and ``why`` (:meth:`runtime.QuantSupport.to_dict`; None: not marked).
        context: tokens to quote the KV cache at (default: :data:`QUOTED_CONTEXT`, capped by
            the model's context).
        listing, shape: :func:`.api.repo_listing` and :func:`.api.remote_shape` (tests pass others).

    Returns:
        ``{"repo_id", "ref", "commit", "revision", "license", "gated", "architecture",
        "supported", "context", "shape": {...} or None, "shape_error", "files": [{"name",
        "ref", "quant", "size_bytes", "split", "parts", "installed", "kept_bytes", "sha256",
        "runs", "fit"}]}``; a file's ``runs`` is ``runs(...)`` plus ``block_type`` and ``extra_bytes``
        (None without ``runs`` or a quant tag); its ``fit`` is of ``size_bytes + extra_bytes``, None
        when split, when it will not run, or when the shape could not be read.

    Raises:
        HubError: the listing failed (offline, not found, gated listing...).
    """
    listing = (listing or api.repo_listing)(repo_id, revision)
    read_shape = shape or api.remote_shape
    singles = [g for g in listing.ggufs if not g.split]
    shp, shape_error = None, ""
    if singles:
        try:
            shp = read_shape(listing.repo_id, singles[0], listing.revision)
        except HubError as exc:
            shape_error = str(exc)
    quoted = context or min(QUOTED_CONTEXT, (shp.context_length if shp else 0) or QUOTED_CONTEXT)
    local = {f.filename for f in installed_files(listing.repo_id) if f.complete}
    files = []
    for g in listing.ggufs:
        f_fit = None
        f_runs = _runs(runs, g.quant, g.size_bytes)
        if fit is not None and shp is not None and not g.split and (f_runs is None or f_runs["runs"] != "no"):
            try:
                f_fit = fit(g.size_bytes + (f_runs or {}).get("extra_bytes", 0), shp, quoted, tag_block_type(g.quant))
            except Exception:  # noqa: BLE001 - a fit that cannot be computed is shown as unknown
                log.warning("fit of %s failed", g.name, exc_info=True)
        sha = g.parts[0].sha256
        files.append({"name": g.name, "ref": f"hf.co/{listing.repo_id}/{g.name}", "quant": g.quant,
                      "size_bytes": g.size_bytes, "split": g.split, "parts": len(g.parts),
                      "installed": g.name in local, "kept_bytes": partial_bytes(sha), "sha256": sha, "runs": f_runs,
                      "fit": f_fit})
    shape_dict = None
    if shp is not None:
        shape_dict = {"architecture": shp.architecture, "layers": shp.n_layers, "heads": shp.n_heads,
                      "kv_heads": shp.n_kv_heads, "head_dim": shp.head_dim, "context_length": shp.context_length,
                      "windows": list(shp.windows)}
    return {"repo_id": listing.repo_id, "ref": f"hf.co/{listing.repo_id}", "commit": listing.commit,
            "revision": listing.revision, "license": listing.license, "gated": listing.gated,
            "architecture": (shp.architecture if shp else "") or listing.architecture,
            "supported": shp.supported if shp else listing.supported, "context": quoted, "shape": shape_dict,
            "shape_error": shape_error, "files": files}
