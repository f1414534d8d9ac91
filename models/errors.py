"""The errors of fetching a model: one line each, what went wrong and what to do.

Stdlib only; every other module of the package may import this one.
"""
from __future__ import annotations

__all__ = ["FetchCancelled", "FetchError", "HubError"]


class FetchError(Exception):
    """A fetch failed; ``str()`` is one line: what went wrong and what to do."""


class FetchCancelled(FetchError):
    """The fetch was cancelled through its ``cancel`` callback."""


class HubError(FetchError):
    """A Hugging Face Hub request or download failed; ``str()`` is one line.

    Attributes:
        kind: what failed, for a caller that shows each differently: ``"offline"`` (no
            network, or ``HF_HUB_OFFLINE``), ``"not_found"`` (repo, file or revision),
            ``"gated"`` (terms to accept, or no access granted yet), ``"auth"`` (the saved
            token was refused), ``"checksum"``, ``"disk_full"``, ``"split"`` (a split GGUF),
            ``"unsupported"`` (an architecture attnchat does not run), ``"ref"`` (a reference
            attnchat does not understand), ``"server"`` (any other answer), ``"write"``,
            ``"refused"`` (the file fails :mod:`models.safety`'s rules; not kept), ``"name"``
            (the Hub sent a name that is no plain file name: nothing fetched), ``"size"``
            (the Hub's sizes disagree, or it sent more bytes than listed: nothing kept).
    """

    def __init__(self, message: str, kind: str = "server"):
        super().__init__(" ".join(message.split()))
        self.kind = kind
