"""Models from the Hugging Face Hub: references, search, a repo's GGUF files, downloads.

- :mod:`.ref`        ``hf.co/OWNER/REPO:QUANT`` and ``hf.co/OWNER/REPO/FILE.gguf``; quant tags; split GGUFs (stdlib)
- :mod:`.gguf_meta`  a GGUF's shape (layers, heads, windows) from the start of its file (stdlib)
- :mod:`.local`      where downloads live in the model folder, and what is there (stdlib)
- :mod:`.api`        search, a repo's listing, a file's address and shape, through huggingface_hub
- :mod:`.download`   resumable, checked, atomic downloads through huggingface_hub's ``http_get``
- :mod:`.report`     a repo's files with sizes, quants and fits (the fit from the caller's planner)

May import the stdlib, platformdirs, huggingface_hub (only inside functions, so importing
this package stays cheap) and :mod:`models`' own base modules; never torch, transformers,
gguf or Qt.
"""
from __future__ import annotations

from .gguf_meta import SUPPORTED_ARCHITECTURES, GGUFMetaError, GGUFShape, read_shape, shape_from_file
from .local import LocalHubFile, find_installed, hub_path, installed_files, partial_bytes
from .report import QUOTED_CONTEXT, files_report
from .ref import DEFAULT_QUANT, GGUFFile, HubFile, HubRef, RefError, choose, group_files, is_hub_ref, parse_ref, quant_tag, tag_block_type

__all__ = [
    "DEFAULT_QUANT", "QUOTED_CONTEXT", "files_report", "GGUFFile", "GGUFMetaError", "GGUFShape", "HubFile", "HubRef", "LocalHubFile", "RefError",
    "SUPPORTED_ARCHITECTURES", "choose", "fetch_hub", "find_installed", "group_files", "hub_path", "installed_files",
    "is_hub_ref", "partial_bytes", "parse_ref", "quant_tag", "tag_block_type", "read_shape", "remote_shape", "repo_listing", "resolve_hub", "search",
    "shape_from_file",
]


def __getattr__(name: str):
    """The functions that use huggingface_hub, imported on first use."""
    if name in ("search", "repo_listing", "remote_shape"):
        from . import api

        return getattr(api, name)
    if name in ("fetch_hub", "resolve_hub"):
        from . import download

        return getattr(download, name)
    raise AttributeError(name)
