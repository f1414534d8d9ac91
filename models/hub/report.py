"""A repo's GGUF files as the command line (``attnchat models files``) and the app's Hub
browser show them: each file's size, quant, whether it is here, and its fit on this machine.

The fit itself comes from the caller (:func:`runtime.fit`, the memory planner, which this
package may not import): ``fit(size_bytes, shape, context) -> dict``. The model's shape is
read once, from the smallest single-file GGUF's header (every quant of a repo is the same
model). Imports huggingface_hub only through :mod:`.api`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from models.errors import HubError

from . import api
from .local import installed_files, partial_bytes

__all__ = ["QUOTED_CONTEXT", "files_report"]

log = logging.getLogger(__name__)

QUOTED_CONTEXT = 8192
"""The context a fit is quoted at by default (tokens; capped by the model's own)."""

FitFn = Callable[[int, Any, int], dict]


def files_report(repo_id: str, *, revision: str = "main", fit: FitFn | None = None,
                 context: int | None = None, listing: Callable = None, shape: Callable = None) -> dict:
    """``repo_id``'s GGUF models with sizes, quants and fits.

    Args:
        fit: ``fit(size_bytes, shape, context) -> dict`` (None: no fits).
        context: tokens to quote the KV cache at (default: :data:`QUOTED_CONTEXT`, capped by
            the model's context).
        listing, shape: :func:`.api.repo_listing` and :func:`.api.remote_shape` (tests pass others).

    Returns:
        ``{"repo_id", "ref", "commit", "revision", "license", "gated", "architecture",
        "supported", "context", "shape": {...} or None, "shape_error", "files": [{"name",
        "ref", "quant", "size_bytes", "split", "parts", "installed", "kept_bytes", "sha256",
        "fit"}]}``; a file's ``fit`` is None when split, or when the shape could not be read.

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
        if fit is not None and shp is not None and not g.split:
            try:
                f_fit = fit(g.size_bytes, shp, quoted)
            except Exception:  # noqa: BLE001 - a fit that cannot be computed is shown as unknown
                log.warning("fit of %s failed", g.name, exc_info=True)
        sha = g.parts[0].sha256
        files.append({"name": g.name, "ref": f"hf.co/{listing.repo_id}/{g.name}", "quant": g.quant,
                      "size_bytes": g.size_bytes, "split": g.split, "parts": len(g.parts),
                      "installed": g.name in local, "kept_bytes": partial_bytes(sha), "sha256": sha, "fit": f_fit})
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
