"""attnchat's model catalog, model folder, fetching and importing, and the Hugging Face Hub
(:mod:`models.hub`: search, a repo's GGUF files, resumable checked downloads).

Stdlib, platformdirs and huggingface_hub (imported only inside the functions that use
it): this package must never import torch, transformers or Qt (an import-linter
contract and ``tests/models/test_no_torch.py`` enforce it), so the command line and
the desktop can use it cheaply.

The public API is re-exported here.  ``models.fetch`` stays the *module* (so
``from models import fetch; fetch.ensure_default()`` works); its ``fetch()``
function is re-exported as :func:`fetch_model`.
"""
from __future__ import annotations

from .catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, UnknownModelError, get
from .errors import FetchCancelled, FetchError, HubError
from .fetch import ensure_default, resolve
from .fetch import fetch as fetch_model
from .paths import cache_dir, log_dir, models_dir
from .store import (
    ImportModelError,
    ModelInfo,
    import_model,
    installed_path,
    list_models,
    verify,
)

__all__ = [
    "CATALOG", "DEFAULT_MODEL", "CatalogEntry", "FetchCancelled", "FetchError", "HubError", "ImportModelError",
    "ModelInfo", "UnknownModelError", "cache_dir", "ensure_default", "fetch_model", "get",
    "import_model", "installed_path", "list_models", "log_dir", "models_dir", "resolve", "verify",
]
